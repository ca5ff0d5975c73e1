"""What the simulated accelerator charges for the model runner: its host work and kernel floors.

On a GPU the runner lives on the engine thread (the in-process executor): each step it
prepares inputs, launches the forward (one CUDA-graph replay for a pure decode step, or one
launch per op for a prefill or draft-verification step), applies the grammar bitmask, samples
and copies the tokens back. On the H200 that host work, not the GPU, set the pace
(``bench/results/gpu_check.json``: 1.4-14 ms of host time per step against 0.9 ms of kernels
at the default model's shape). A simulator that charges none of it reports structured
decoding as free when it is not. So the simulated executor spends this host time on the
engine thread (a spin, as the real runner's Python would), and gives each forward the kernel
time a real one has: every kernel costs at least ``kernel_floor_s``, however small.

The costs are a linear model whose coefficients come from the GPU check by least squares
(``bench/sim/sim_calibration.py``; the fitted values and the cells they were fitted to live in
``sim_calibration.json`` beside this file). Host costs there are in the GPU machine's host
seconds; this host runs the same work ``host_scale`` times slower (``host_speed.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

CALIBRATION_PATH = Path(__file__).with_name("sim_calibration.json")

# Host-cost coefficients fitted by least squares, in the order of ``RunnerStep.features`` (the
# fit's design matrix). ``sample_s``, the fixed host cost of sampling, is not among them: every
# step pays it as it pays ``step_s``, so no fit can tell the two apart; the profile's split
# between the runner's launch and sampling parts sets it (``bench/sim/sim_calibration.py``).
HOST_COEFFICIENTS = (
    "step_s",
    "row_s",
    "eager_kernel_s",
    "eager_token_s",
    "draft_row_s",
    "draft_step_s",
    "mask_s",
    "mask_row_s",
)


@dataclass(frozen=True)
class RunnerCalibration:
    """The runner's costs on one GPU machine, fitted to its GPU check.

    Host coefficients are seconds of that machine's host (``HOST_COEFFICIENTS``):
        step_s, row_s: preparing a step (state changes, inputs, copies), fixed and per request.
        eager_kernel_s: launching one kernel from Python, in a step that runs op by op.
        eager_token_s: per token of such a step (its inputs and attention metadata).
        sample_s: logits, sampling and the copy back, fixed (the GPU profile's sampling laps
            at batch 32, not fitted; their per-row part is in ``row_s``, which every sampling
            request also pays: the two cannot be told apart).
        draft_row_s: per logits row of a draft position (the verification's bookkeeping:
            grammar rows of the drafts, acceptance, rollback).
        draft_step_s: fixed, in a step that verifies drafts (its forward takes the multi-token
            path: on the H200 such steps cost 13-18 ms more host time than op-by-op decode).
        mask_s, mask_row_s: the grammar bitmask to the device and applied, fixed and per row.

    Device figures:
        kernel_floor_s: the least time a kernel takes (launch gaps inside a graph included).
        graph_kernels_per_layer, graph_kernels_fixed: kernels of a graphed decode forward.
        eager_kernels_per_layer, eager_kernels_fixed: kernels of a forward run op by op.
        sample_kernels, mask_kernels: kernels of a sampling pass and of a bitmask apply.
        max_graph_batch: the most requests a captured decode graph serves.

    Provenance:
        source: what the figures were fitted to (file, commit, GPU).
        host_speed_s: ``host_speed.measure_host_speed()`` on that machine's host.
        host_speed_estimated: True where that figure was inferred (from the engine's own phase
            times there and here) because the GPU check did not yet measure it.

    Raises:
        ValueError: a negative cost, a non-positive floor or host speed, or a graph batch < 1.
    """

    source: str
    host_speed_s: float
    host_speed_estimated: bool
    kernel_floor_s: float
    graph_kernels_per_layer: float
    graph_kernels_fixed: float
    eager_kernels_per_layer: float
    eager_kernels_fixed: float
    sample_kernels: float
    mask_kernels: float
    max_graph_batch: int
    step_s: float
    row_s: float
    eager_kernel_s: float
    eager_token_s: float
    sample_s: float
    draft_row_s: float
    draft_step_s: float
    mask_s: float
    mask_row_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"RunnerCalibration.{f.name} must be >= 0, got {value!r}")
        if self.kernel_floor_s <= 0 or self.host_speed_s <= 0:
            raise ValueError("RunnerCalibration.kernel_floor_s and host_speed_s must be > 0")
        if self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")

    def host_coefficients(self) -> tuple[float, ...]:
        """The fitted host coefficients in ``HOST_COEFFICIENTS`` order."""
        return tuple(getattr(self, name) for name in HOST_COEFFICIENTS)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunnerCalibration:
        """The calibration in ``data`` (other keys, such as the fitted cells, are ignored).

        Raises:
            ValueError: a missing field or a bad value.
        """
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"runner calibration lacks {missing}")
        return cls(**{n: data[n] for n in names})


def load_calibration(path: Path = CALIBRATION_PATH) -> RunnerCalibration:
    """The calibration stored at ``path`` (its ``"calibration"`` object).

    Raises:
        ValueError: the file is not a calibration; OSError: it cannot be read.
    """
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "calibration" not in data:
        raise ValueError(f"{path}: no 'calibration' object")
    return RunnerCalibration.from_json(data["calibration"])


class RunnerStep(NamedTuple):
    """What the runner model reads of one step."""

    graphed: bool  # a pure decode step of at most max_graph_batch requests: one graph replay
    rows: int  # requests in the step
    tokens: int  # tokens fed
    logits_rows: int  # rows sampled (one per sampling request and one per draft)
    draft_rows: int  # logits rows of draft positions
    mask_rows: int  # grammar bitmask rows applied (0: no grammar in the step)
    eager_kernels: float  # kernels launched one by one (0 for a graphed step)

    def features(self) -> tuple[float, ...]:
        """The step's terms, in ``HOST_COEFFICIENTS`` order: its host seconds are their dot
        product with the coefficients, plus ``sample_s``."""
        eager = 0.0 if self.graphed else 1.0
        has_mask = 1.0 if self.mask_rows else 0.0
        return (
            1.0,
            float(self.rows),
            self.eager_kernels,
            eager * self.tokens,
            float(self.draft_rows),
            1.0 if self.draft_rows else 0.0,
            has_mask,
            float(self.mask_rows),
        )


class RunnerModel:
    """The costs of steps of a model with ``num_layers`` layers, on this host.

    Args:
        calibration: the fitted costs.
        num_layers: the simulated model's layers (kernel counts scale with them).
        host_scale: how many times longer this host takes for the reference host's work.
        enforce_eager: no decode graphs (every step op by op), as ``EngineConfig.enforce_eager``.
    """

    def __init__(
        self,
        calibration: RunnerCalibration,
        num_layers: int,
        host_scale: float,
        enforce_eager: bool = False,
    ) -> None:
        if host_scale <= 0:
            raise ValueError(f"host_scale must be > 0, got {host_scale}")
        c = calibration
        self.calibration = c
        self.host_scale = host_scale
        self.enforce_eager = enforce_eager
        self._graph_kernels = c.graph_kernels_per_layer * num_layers + c.graph_kernels_fixed
        self._eager_kernels = c.eager_kernels_per_layer * num_layers + c.eager_kernels_fixed

    def step(
        self, num_scheduled: dict[str, int], drafts: dict[str, Any], logits_rows: int
    ) -> RunnerStep:
        """The runner's view of a step (``SchedulerOutput.num_scheduled_tokens`` and
        ``scheduled_spec_decode_tokens``); its mask rows are set at sampling time."""
        tokens = sum(num_scheduled.values())
        rows = len(num_scheduled)
        graphed = (
            not self.enforce_eager
            and not drafts
            and tokens == rows
            and rows <= self.calibration.max_graph_batch
        )
        eager = 0.0 if graphed else self._eager_kernels
        draft_rows = sum(len(d) for d in drafts.values())
        return RunnerStep(graphed, rows, tokens, logits_rows, draft_rows, 0, eager)

    def launch_host_s(self, step: RunnerStep) -> float:
        """Host seconds of ``execute_model`` here: preparing the step and launching its
        forward."""
        c = self.calibration
        s = c.step_s + c.row_s * step.rows
        if step.draft_rows:
            s += c.draft_step_s
        if not step.graphed:
            s += c.eager_kernel_s * step.eager_kernels + c.eager_token_s * step.tokens
        return s * self.host_scale

    def sample_host_s(self, step: RunnerStep) -> float:
        """Host seconds of ``sample_tokens`` here (``step.mask_rows`` set)."""
        c = self.calibration
        s = c.sample_s + c.draft_row_s * step.draft_rows
        if step.mask_rows:
            s += c.mask_s + c.mask_row_s * step.mask_rows
        return s * self.host_scale

    def forward_floor_s(self, step: RunnerStep) -> float:
        """The least device time of the step's forward: its kernels at the floor each."""
        kernels = self._graph_kernels if step.graphed else self._eager_kernels
        return kernels * self.calibration.kernel_floor_s

    def sample_floor_s(self, mask_rows: int) -> float:
        """The least device time of a sampling pass (with a bitmask apply when ``mask_rows``)."""
        c = self.calibration
        kernels = c.sample_kernels + (c.mask_kernels if mask_rows else 0.0)
        return kernels * c.kernel_floor_s
