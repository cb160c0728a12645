"""`scripts/gpu_check.py`: one command that validates the GPU path and writes docs/gpu_validation.md (a full run
from a checkout; a --tiny run writes ./gpu_validation.md, see runner).

device    the device, its dense bf16 peak, versions, timers and peak memory
models    SD3.5-Medium / FLUX.1-dev / Qwen2.5-0.5B at their real sizes with random weights (or tiny)
image     SD3.5-M rollout and LoRA step through our sampler / adapter / objective against a plain
          diffusers pipeline loop, MFU from counted FLOPs, the on-policy ratio; FLUX step with
          gradient checkpointing
video     Wan 2.1-T2V-14B-size video rollout frames/s against WanPipeline, counted FLOPs / MFU, and LoRA step
          (480 x 832 x 81 frames), checkpointed
text      a text GRPO step with HF generation, and with vLLM when installed
report    the markdown and JSON report
runner    the command line
"""
