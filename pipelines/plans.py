"""Rollout plans: for every denoising step, what kind of transition it is and what is done with it.

A plan says per step whether it is SDE or ODE, whether its edges are trained, whether the state
branches into k children that all continue (BranchGRPO tree) or into k side children that are only
completed by ODE and scored (TempFlow-GRPO branch points), and which node depths get a deterministic
probe completion to x0 for scoring (TP-GRPO, VGPO). Plans are plain data; the sampler runs them.

Builders are registered by name. Their positional-only arguments are runtime inputs (number of steps,
training iteration, a random.Random shared by all ranks); their keyword-only arguments are settings.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from flowgrpo.core.config import FRACTION, NON_NEGATIVE, bound_settings, count, one_of
from flowgrpo.core.registry import Registry

PLANS = Registry("rollout plan")


@dataclass(frozen=True)
class StepPlan:
    """What happens at step i (from node depth i to depth i + 1).

    sde:           stochastic transition (else deterministic ODE).
    trained:       its edges enter the loss.
    branch:        children per node that all continue (tree split; 1 = a chain).
    side_branches: extra SDE children that do not continue: each is completed by ODE and scored.
    noise_scale:   split-noise multiplier for branching children (BranchGRPO).
    solver:        ODE solver of a deterministic step ("euler" or "dpm2m").
    """

    sde: bool
    trained: bool
    branch: int = 1
    side_branches: int = 0
    noise_scale: float = 1.0
    solver: str = "euler"


@dataclass(frozen=True)
class CompressedTail:
    """MixGRPO-Flash: after grid index `start`, the sampler's `grid_steps`-step grid is rebuilt with `points`
    points (from sigma_start to 0, time-shifted), so the plan has start + points - 1 steps."""

    start: int
    points: int
    grid_steps: int


@dataclass(frozen=True)
class RolloutPlan:
    name: str
    steps: tuple[StepPlan, ...]
    probe_depths: frozenset[int] = field(default_factory=frozenset)
    probe_solver: str = "euler"
    one_step_probes: bool = False  # VGPO: x0 estimate by one Euler jump instead of a full completion
    shared_prefix: bool = False  # deterministic steps before the first SDE step are the same for a group
    tail: Optional[CompressedTail] = None  # the grid after the last SDE step is re-gridded (MixGRPO-Flash)

    @property
    def grid_steps(self) -> int:
        """The sampler's num_steps this plan was built for (= num_steps unless the tail is compressed)."""
        return self.num_steps if self.tail is None else self.tail.grid_steps

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def leaves_per_root(self) -> int:
        return math.prod(s.branch for s in self.steps)

    @property
    def edges_per_root(self) -> int:
        """Transitions in one tree (side branches not counted): the nodes at depths 1..T."""
        total, width = 0, 1
        for s in self.steps:
            width *= s.branch
            total += width
        return total

    @property
    def trained_steps(self) -> list[int]:
        return [i for i, s in enumerate(self.steps) if s.trained]

    @property
    def first_stochastic_step(self) -> Optional[int]:
        return next((i for i, s in enumerate(self.steps) if s.sde or s.side_branches), None)

    def validate(self) -> "RolloutPlan":
        for i, s in enumerate(self.steps):
            if s.trained and not (s.sde or s.side_branches):
                raise ValueError(f"step {i}: a deterministic step cannot be trained (its log-prob is not defined)")
            if s.branch < 1 or s.side_branches < 0:
                raise ValueError(f"step {i}: branch must be >= 1 and side_branches >= 0")
            if s.branch > 1 and not s.sde:
                raise ValueError(f"step {i}: branching children need an SDE step (identical children otherwise)")
            if s.solver not in ("euler", "dpm2m"):
                raise ValueError(f"step {i}: solver must be 'euler' or 'dpm2m', got {s.solver!r}")
        bad = [d for d in self.probe_depths if not 0 <= d < self.num_steps]
        if bad:
            raise ValueError(f"probe_depths {sorted(bad)} outside [0, {self.num_steps - 1}]")
        return self


def _chain(num_steps: int, sde: Sequence[bool], trained: Sequence[bool], solver: Sequence[str] | None = None) -> tuple:
    solver = solver or ["euler"] * num_steps
    return tuple(StepPlan(sde=s, trained=t, solver=v) for s, t, v in zip(sde, trained, solver))


def _check_steps(num_steps: int) -> None:
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")


@PLANS.register("full_sde")
def full_sde(
    num_steps: int,
    iteration: int = 0,
    rng: Optional[random.Random] = None,
    /,
    *,
    train_fraction: float = 0.99,
    random_subset: Optional[int] = None,
) -> RolloutPlan:
    """Flow-GRPO: every step SDE; the first floor(T * train_fraction) steps (high noise first) are trained.

    random_subset = k trains k random steps instead (DanceGRPO's timestep_fraction sampling).
    """
    _check_steps(num_steps)
    if random_subset is not None:
        chosen = set((rng or random.Random(iteration)).sample(range(num_steps), min(random_subset, num_steps)))
        trained = [i in chosen for i in range(num_steps)]
    else:
        n = max(1, int(num_steps * train_fraction))
        trained = [i < n for i in range(num_steps)]
    return RolloutPlan("full_sde", _chain(num_steps, [True] * num_steps, trained)).validate()


def _window_start(
    num_steps: int,
    iteration: int,
    rng: Optional[random.Random],
    size: int,
    schedule: str,
    start: int,
    range_end: Optional[int],
    stride: int,
    iters_per_shift: int,
    max_iters: int,
    min_iters: int,
) -> int:
    end = num_steps if range_end is None else range_end
    if end > num_steps:  # a start past the chain would leave some iterations without any trained step
        raise ValueError(f"range_end {end} lies past the chain's {num_steps} steps")
    last = end - size  # the last valid start
    if not 0 <= start <= last:
        raise ValueError(f"window of size {size} starting at {start} does not fit before step {end}")
    positions = list(range(start, last + 1, stride))
    if schedule == "fixed":
        return start
    if schedule == "random":
        return (rng or random.Random(iteration)).choice(positions)
    if schedule == "progressive":  # high noise to low noise, rolling back to the start
        return positions[(iteration // iters_per_shift) % len(positions)]
    if schedule == "decay":  # fewer iterations per position as the window reaches low noise
        if not 1 <= min_iters <= max_iters:
            raise ValueError(f"decay schedule: need 1 <= min_iters <= max_iters, got {min_iters} and {max_iters}")
        n = len(positions)
        stay = [round(max_iters - (max_iters - min_iters) * p / max(n - 1, 1)) for p in range(n)]
        t = iteration % sum(stay)
        for pos, k in zip(positions, stay):
            if t < k:
                return pos
            t -= k
    raise ValueError(f"schedule: expected fixed, random, progressive or decay, got {schedule!r}")


@PLANS.register("window")
def window(
    num_steps: int,
    iteration: int = 0,
    rng: Optional[random.Random] = None,
    /,
    *,
    size: int = 3,
    schedule: str = "random",
    start: int = 0,
    range_end: Optional[int] = None,
    stride: int = 1,
    iters_per_shift: int = 25,
    max_iters: int = 10,
    min_iters: int = 1,
    post_solver: str = "euler",
    share_prefix: bool = True,
    post_compress: Optional[float] = None,
) -> RolloutPlan:
    """Flow-GRPO-Fast and MixGRPO: SDE and trained inside a window, ODE outside.

    Flow-GRPO-Fast: schedule=random, range_end=T/2, size 1-3. MixGRPO: schedule=progressive (or decay),
    size 4. MixGRPO-Flash: post_solver=dpm2m (2nd-order solver after the window) and post_compress = c
    (`dpm_post_compress_ratio`): the grid after the window is rebuilt with max(int((T - L) c), 1)
    points from the first sigma after the window to 0 (L = the window's last step; MixGRPO's
    `sigma_schedule.size(0) - 1 - last_false_index` with T + 1 grid points), on the sampler's
    time_shift grid, as MixGRPO's run_sample_step does; fewer steps are then run after the window.
    """
    _check_steps(num_steps)
    s0 = _window_start(
        num_steps, iteration, rng, size, schedule, start, range_end, stride, iters_per_shift, max_iters, min_iters
    )
    tail, total = None, num_steps
    if post_compress is not None:
        if not 0 < post_compress <= 1:
            raise ValueError(f"post_compress must be in (0, 1], got {post_compress}")
        last = s0 + size - 1
        points = max(int((num_steps - last) * post_compress), 1)
        if points < 2:
            raise ValueError(
                f"post_compress {post_compress} leaves {points} point after step {last} of {num_steps}: "
                "the rebuilt tail would not reach sigma 0 (MixGRPO's grid then ends noisy)"
            )
        tail = CompressedTail(start=last + 1, points=points, grid_steps=num_steps)
        total = last + points
    inside = [s0 <= i < s0 + size for i in range(total)]
    solver = ["euler" if i < s0 + size else post_solver for i in range(total)]
    return RolloutPlan(
        "window", _chain(total, inside, inside, solver), shared_prefix=share_prefix, tail=tail
    ).validate()


@PLANS.register("tree")
def tree(
    num_steps: int,
    iteration: int = 0,
    rng: Optional[random.Random] = None,
    /,
    *,
    split_steps: Sequence[int] = (0, 3, 6, 9),
    branch: int = 2,
    noise_scale: float = 1.0,
    mix_window: Optional[int] = None,
    mix_stride: int = 1,
    mix_iters_per_shift: int = 25,
    mix_period: Optional[int] = None,
) -> RolloutPlan:
    """BranchGRPO: every step SDE and trained; at each split step every node gets `branch` children.

    mix_window = w gives BranchGRPO-Mix: SDE only inside a sliding window of w steps and at split steps;
    the other steps are ODE and untrained. mix_period = p instead applies the released code's rule
    (train_branchgrpo_flux.py, `mix_ode_sde_tree`): step i is SDE iff i % p < w, the same every
    iteration (p is its depth_pruning_slide_interval, 30 in the 8-GPU script: with 20 steps, steps 0-3).
    Width / depth pruning select edges for training only and live in the trainer's edge selection.
    """
    _check_steps(num_steps)
    splits = set(split_steps)
    if any(not 0 <= s < num_steps for s in splits):
        raise ValueError(f"split_steps {sorted(splits)} must lie in [0, {num_steps - 1}]")
    if mix_period is not None and (mix_window is None or mix_period < 1):
        raise ValueError(f"mix_period={mix_period} needs mix_window and must be >= 1")
    if mix_window is None:
        sde = [True] * num_steps
    elif mix_period is not None:
        sde = [i in splits or i % mix_period < mix_window for i in range(num_steps)]
    else:
        s0 = _window_start(
            num_steps, iteration, rng, mix_window, "progressive", 0, None, mix_stride, mix_iters_per_shift, 1, 1
        )
        sde = [i in splits or s0 <= i < s0 + mix_window for i in range(num_steps)]
    steps = tuple(
        StepPlan(sde=s, trained=s, branch=branch if i in splits else 1, noise_scale=noise_scale if i in splits else 1.0)
        for i, s in enumerate(sde)
    )
    return RolloutPlan("tree", steps).validate()


@PLANS.register("branch_points")
def branch_points(
    num_steps: int,
    iteration: int = 0,
    rng: Optional[random.Random] = None,
    /,
    *,
    points: Optional[Sequence[int]] = None,
    k: int = 6,
    fraction: float = 0.99,
) -> RolloutPlan:
    """TempFlow-GRPO: an ODE spine; at each branch point k SDE side children, each ODE-completed and scored.

    Only the side edges are trained. Default points: the first floor(T * fraction) steps.
    """
    _check_steps(num_steps)
    pts = set(range(max(1, int(num_steps * fraction)))) if points is None else set(points)
    if any(not 0 <= p < num_steps for p in pts):
        raise ValueError(f"points {sorted(pts)} must lie in [0, {num_steps - 1}]")
    steps = tuple(StepPlan(sde=False, trained=i in pts, side_branches=k if i in pts else 0) for i in range(num_steps))
    return RolloutPlan("branch_points", steps).validate()


@PLANS.register("probes")
def probes(
    num_steps: int,
    iteration: int = 0,
    rng: Optional[random.Random] = None,
    /,
    *,
    window_start: int = 0,
    window_end: Optional[int] = None,
    one_step: bool = False,
) -> RolloutPlan:
    """TP-GRPO / VGPO: an SDE chain with a probe from every node up to the window end.

    The probe at depth 0 is the pure-ODE sample from the same initial noise (TP-GRPO's R_0). TP-GRPO:
    window (0, T-1) with full ODE completions; VGPO: one_step=True (a single Euler jump to x0).
    """
    _check_steps(num_steps)
    end = num_steps - 1 if window_end is None else window_end
    if not 0 <= window_start < end <= num_steps:
        raise ValueError(f"window ({window_start}, {end}) must satisfy 0 <= start < end <= {num_steps}")
    inside = [window_start <= i < end for i in range(num_steps)]
    depths = frozenset(range(0, end))
    return RolloutPlan(
        "probes", _chain(num_steps, inside, inside), probe_depths=depths, one_step_probes=one_step
    ).validate()


@PLANS.register("ode_only")
def ode_only(
    num_steps: int, iteration: int = 0, rng: Optional[random.Random] = None, /, *, solver: str = "euler"
) -> RolloutPlan:
    """Deterministic sampling (evaluation, DiffusionNFT rollouts); nothing is trained."""
    _check_steps(num_steps)
    return RolloutPlan(
        "ode_only", _chain(num_steps, [False] * num_steps, [False] * num_steps, [solver] * num_steps)
    ).validate()


# Each setting's range, checked when the config loads (`flowgrpo.core.config.bound_settings`); what depends on the
# number of steps (a window that fits, split steps inside the chain) is checked there by building the plan once.
_SOLVERS = one_of("euler", "dpm2m")
bound_settings(PLANS, "full_sde", train_fraction=FRACTION, random_subset=count(1))
bound_settings(
    PLANS, "window", size=count(1), schedule=one_of("fixed", "random", "progressive", "decay"), start=count(0),
    range_end=count(1), stride=count(1), iters_per_shift=count(1), max_iters=count(1), min_iters=count(1),
    post_solver=_SOLVERS, post_compress=FRACTION,
)  # fmt: skip
bound_settings(
    PLANS, "tree", branch=count(2), noise_scale=NON_NEGATIVE, mix_window=count(1), mix_stride=count(1),
    mix_iters_per_shift=count(1), mix_period=count(1),
)  # fmt: skip
bound_settings(PLANS, "branch_points", k=count(2), fraction=FRACTION)  # k siblings are z-scored: 1 learns nothing
bound_settings(PLANS, "probes", window_start=count(0), window_end=count(1))
bound_settings(PLANS, "ode_only", solver=_SOLVERS)


def build_plan(name: str, num_steps: int, iteration: int = 0, seed: int = 0, **settings) -> RolloutPlan:
    """The named plan for this iteration; random choices depend only on (seed, iteration), so every rank agrees."""
    entry = PLANS.get(name)
    entry.check_settings(settings, PLANS.kind)
    return entry.fn(num_steps, iteration, random.Random(seed * 1_000_003 + iteration), **settings)


def with_steps(plan: RolloutPlan, **changes) -> RolloutPlan:
    """A copy of `plan` with every step changed (e.g. noise_scale=1.0)."""
    return replace(plan, steps=tuple(replace(s, **changes) for s in plan.steps)).validate()
