"""Per-step sampling parameters, one row per sequence that samples this step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_INT64_MASK = (1 << 64) - 1


def _wrap_int64(value: int) -> int:
    # Seeds are arbitrary Python ints (users pass 2**64 - 1, negatives, ...);
    # only their low 64 bits matter to the hash.
    value &= _INT64_MASK
    return value - (1 << 64) if value >= (1 << 63) else value


def _check_row_tensor(
    name: str, tensor: torch.Tensor, num_rows: int, kind: str, device: torch.device
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.shape[0] != num_rows:
        raise ValueError(
            f"{name} must have shape [{num_rows}] (one entry per row), got {tuple(tensor.shape)}"
        )
    _check_kind(name, tensor, kind)
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like temperature")


def _check_kind(name: str, tensor: torch.Tensor, kind: str) -> None:
    if kind == "float" and not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if kind == "int" and (tensor.dtype.is_floating_point or tensor.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if kind == "int64" and tensor.dtype != torch.int64:
        raise ValueError(f"{name} must be an int64 tensor, got {tensor.dtype}")
    if kind == "bool" and tensor.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {tensor.dtype}")


@dataclass(frozen=True)
class SamplingMetadata:
    """Sampling parameters for the N rows that sample this step.

    All tensors live on the logits' device. A per-row parameter that is off for
    every row is None, so the sampler can skip its work entirely. Shapes, dtypes
    and devices are checked on construction; values are checked too when the
    tensors are on the CPU (checking them on an accelerator would make the host
    wait for the device), and always by `build`.

    Fields:
        temperature: float [N]; 0.0 means greedy for that row.
        all_greedy / all_random: every row has temperature 0 / > 0 (both True only
            when N == 0). The sampler trusts them to skip a path.
        top_k: int [N]; 0 or >= vocab means off.
        top_p: float [N] in (0, 1]; 1.0 means off.
        min_p: float [N] in [0, 1]; 0.0 means off.
        seeds: int64 [N]; the row's random stream.
        positions: int64 [N]; index of the output token being sampled (0 first).
        repetition_penalty: float [N] > 0, 1.0 off; for tokens in the prompt or the
            output, positive logits are divided by it and negative ones multiplied.
        presence_penalty: float [N], 0 off; subtracted once from tokens in the output.
        frequency_penalty: float [N], 0 off; subtracted count times.
        prompt_mask: bool [N, V]; the token occurs in the row's prompt.
        output_counts: int [N, V]; occurrences of the token in the output so far.
        max_num_logprobs: None for no logprobs; k >= 0 returns the top k and the
            sampled token's log-probability.

    Raises:
        ValueError: naming the field whose shape, dtype, device or value is wrong,
            or a penalty given without the mask/counts it needs.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: torch.Tensor
    positions: torch.Tensor
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    max_num_logprobs: int | None = None

    @property
    def num_rows(self) -> int:
        """Number of rows (sequences) this metadata describes."""
        return int(self.temperature.shape[0])

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on for some row."""
        return (
            self.repetition_penalty is not None
            or self.presence_penalty is not None
            or self.frequency_penalty is not None
        )

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, torch.Tensor) or self.temperature.dim() != 1:
            raise ValueError("temperature must be a 1-D tensor with one entry per row")
        n = self.num_rows
        device = self.temperature.device
        _check_kind("temperature", self.temperature, "float")
        _check_row_tensor("seeds", self.seeds, n, "int64", device)
        _check_row_tensor("positions", self.positions, n, "int64", device)
        for name, kind in (
            ("top_k", "int"),
            ("top_p", "float"),
            ("min_p", "float"),
            ("repetition_penalty", "float"),
            ("presence_penalty", "float"),
            ("frequency_penalty", "float"),
        ):
            tensor = getattr(self, name)
            if tensor is not None:
                _check_row_tensor(name, tensor, n, kind, device)
        if not isinstance(self.all_greedy, bool) or not isinstance(self.all_random, bool):
            raise ValueError("all_greedy and all_random must be bools")
        if self.all_greedy and self.all_random and n > 0:
            raise ValueError("all_greedy and all_random cannot both be True for a non-empty batch")
        self._check_penalty_inputs(n, device)
        if self.max_num_logprobs is not None and (
            not isinstance(self.max_num_logprobs, int)
            or isinstance(self.max_num_logprobs, bool)
            or self.max_num_logprobs < 0
        ):
            raise ValueError(
                f"max_num_logprobs must be None or an int >= 0, got {self.max_num_logprobs!r}"
            )
        if device.type == "cpu":
            self._check_values()

    def _check_penalty_inputs(self, n: int, device: torch.device) -> None:
        widths = []
        for name, kind in (("prompt_mask", "bool"), ("output_counts", "int")):
            tensor = getattr(self, name)
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[0] != n:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                raise ValueError(f"{name} must have shape [{n}, vocab], got {shape}")
            _check_kind(name, tensor, kind)
            if tensor.device != device:
                raise ValueError(f"{name} is on {tensor.device}, expected {device}")
            widths.append(tensor.shape[1])
        if len(widths) == 2 and widths[0] != widths[1]:
            raise ValueError(
                f"prompt_mask and output_counts disagree on the vocab size: {widths[0]} != "
                f"{widths[1]}"
            )
        if self.repetition_penalty is not None and (
            self.prompt_mask is None or self.output_counts is None
        ):
            raise ValueError("repetition_penalty needs both prompt_mask and output_counts")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None and self.output_counts is None:
                raise ValueError(f"{name} needs output_counts")

    def _check_values(self) -> None:
        t = self.temperature
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError(f"temperature must be finite and >= 0, got {t.tolist()}")
        if self.all_greedy and bool((t != 0).any()):
            raise ValueError("all_greedy is True but some temperature is not 0")
        if self.all_random and bool((t == 0).any()):
            raise ValueError("all_random is True but some temperature is 0")
        if bool((self.positions < 0).any()):
            raise ValueError(f"positions must be >= 0, got {self.positions.tolist()}")
        if self.top_k is not None and bool((self.top_k < 0).any()):
            raise ValueError(f"top_k must be >= 0 (0 is off), got {self.top_k.tolist()}")
        if self.top_p is not None and not bool(((self.top_p > 0) & (self.top_p <= 1)).all()):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p.tolist()}")
        if self.min_p is not None and not bool(((self.min_p >= 0) & (self.min_p <= 1)).all()):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p.tolist()}")
        r = self.repetition_penalty
        if r is not None and not bool((torch.isfinite(r) & (r > 0)).all()):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {r.tolist()}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name} must be finite, got {value.tolist()}")
        if self.output_counts is not None and bool((self.output_counts < 0).any()):
            raise ValueError("output_counts must be >= 0")

    @classmethod
    def build(
        cls,
        *,
        temperature: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        presence_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        vocab_size: int | None = None,
        max_num_logprobs: int | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build metadata from per-row Python lists (for the engine and tests).

        A parameter that is off for every row (or not given) becomes None. Seeds may
        be any Python int; their low 64 bits are used. Penalties need `vocab_size`
        and, for the rows' history, `prompt_token_ids` (repetition penalty only) and
        `output_token_ids`, from which the prompt mask and output counts are built.

        Raises:
            ValueError: a list whose length is not the number of rows, a value out of
                range, or a penalty without the token ids or vocab size it needs.
        """
        n = len(temperature)
        for name, values in (
            ("seeds", seeds),
            ("positions", positions),
            ("top_k", top_k),
            ("top_p", top_p),
            ("min_p", min_p),
            ("repetition_penalty", repetition_penalty),
            ("presence_penalty", presence_penalty),
            ("frequency_penalty", frequency_penalty),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries, expected {n} (one per row)")
        temps = [float(t) for t in temperature]
        if any(not math.isfinite(t) or t < 0 for t in temps):
            raise ValueError(f"temperature must be finite and >= 0, got {temps}")

        def floats(values: Sequence[float] | None, off: float) -> torch.Tensor | None:
            if values is None or all(float(v) == off for v in values):
                return None
            return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)

        _check_ranges(top_k, positions, top_p, min_p)
        top_k_t = None
        if top_k is not None and any(int(k) > 0 for k in top_k):
            top_k_t = torch.tensor([int(k) for k in top_k], dtype=torch.int64, device=device)

        rep = floats(repetition_penalty, 1.0)
        pres = floats(presence_penalty, 0.0)
        freq = floats(frequency_penalty, 0.0)
        prompt_mask, output_counts = _penalty_histories(
            rep is not None,
            pres is not None or freq is not None,
            prompt_token_ids,
            output_token_ids,
            vocab_size,
            device,
        )

        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            all_greedy=all(t == 0.0 for t in temps),
            all_random=all(t > 0.0 for t in temps),
            top_k=top_k_t,
            top_p=floats(top_p, 1.0),
            min_p=floats(min_p, 0.0),
            seeds=torch.tensor(
                [_wrap_int64(int(s)) for s in seeds], dtype=torch.int64, device=device
            ),
            positions=torch.tensor([int(p) for p in positions], dtype=torch.int64, device=device),
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            max_num_logprobs=max_num_logprobs,
        )


def _check_ranges(
    top_k: Sequence[int] | None,
    positions: Sequence[int],
    top_p: Sequence[float] | None,
    min_p: Sequence[float] | None,
) -> None:
    """Raises ValueError naming the first of top_k, positions, top_p, min_p out of range."""
    if top_k is not None and any(int(k) < 0 for k in top_k):
        raise ValueError(f"top_k must be >= 0 (0 is off), got {list(top_k)}")
    if any(int(p) < 0 for p in positions):
        raise ValueError(f"positions must be >= 0, got {list(positions)}")
    if top_p is not None and any(not 0.0 < float(p) <= 1.0 for p in top_p):
        raise ValueError(f"top_p must be in (0, 1], got {list(top_p)}")
    if min_p is not None and any(not 0.0 <= float(p) <= 1.0 for p in min_p):
        raise ValueError(f"min_p must be in [0, 1], got {list(min_p)}")


def _penalty_histories(
    repetition: bool,
    counted: bool,
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]] | None,
    vocab_size: int | None,
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The prompt mask (repetition penalty) and output counts the penalties read: both None
    when no row has a penalty.

    Raises:
        ValueError: a penalty without ``vocab_size`` or the token ids it needs.
    """
    if not (repetition or counted):
        return None, None
    if vocab_size is None or vocab_size <= 0:
        raise ValueError("penalties need vocab_size > 0 to build their token masks")
    if output_token_ids is None:
        raise ValueError("penalties need output_token_ids")
    output_counts = _count_tokens(output_token_ids, vocab_size, device)
    prompt_mask = None
    if repetition:
        if prompt_token_ids is None:
            raise ValueError("repetition_penalty needs prompt_token_ids")
        prompt_mask = _count_tokens(prompt_token_ids, vocab_size, device) > 0
    return prompt_mask, output_counts


def _count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Return int32 [rows, vocab_size] occurrence counts of each row's token ids."""
    counts = torch.zeros((len(token_ids), vocab_size), dtype=torch.int32)
    for row, ids in enumerate(token_ids):
        if len(ids) == 0:
            continue
        ids_t = torch.tensor(list(ids), dtype=torch.int64)
        if bool((ids_t < 0).any()) or bool((ids_t >= vocab_size).any()):
            raise ValueError(
                f"token ids of row {row} must be in [0, {vocab_size}), got {list(ids)}"
            )
        counts[row].index_add_(0, ids_t, torch.ones_like(ids_t, dtype=torch.int32))
    return counts.to(device)
