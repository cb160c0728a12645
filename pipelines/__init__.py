
import reward_models._import_hooks  # noqa: E402,F401  (torchvision on a CPU torch; imports nothing)
