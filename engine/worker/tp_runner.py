"""One rank of a tensor-parallel model: joining the process group, and sampling on rank 0 only.

Every rank runs the same forward on its shard. Sampling needs the whole vocabulary and the
grammar bitmask, so only rank 0 samples: the LM head's slices are gathered to it, and it
broadcasts the sampled tokens back, because every rank keeps the request rows whose last
sampled token is the next step's input (it is never sent through the CPU scheduler).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from baton.engine.models.parallel import TensorParallel
from baton.engine.scheduler_output import GrammarOutput
from baton.engine.worker.device_buffers import HostCopy
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.runner_values import ForwardOutput, SampledTokens

# How long a rank waits for the others, to join or inside a collective, before it fails
# (a dead rank is noticed by the engine first; this only bounds a hang).
COLLECTIVE_TIMEOUT_S = 300.0


def backend_for(device: str) -> str:
    """The ``torch.distributed`` backend for ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def join_group(rank: int, size: int, store_port: int, device: str) -> TensorParallel:
    """Joins the default process group through the engine's TCP store on ``store_port``
    (loopback) and returns this rank's ``TensorParallel``.

    Raises:
        RuntimeError / DistNetworkError: the store or the other ranks cannot be reached within
            ``COLLECTIVE_TIMEOUT_S``.
    """
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    # gloo picks its network interface from the host name, which may not resolve to loopback
    # in a container; the ranks are on this machine.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout
    )
    return TensorParallel(rank, size)


class ParallelModelRunner(ModelRunner):
    """A ``ModelRunner`` over one shard of a tensor-parallel model (``model.tp`` set).

    ``execute_model`` is the base runner's (the collectives are inside the model, the logits
    gather too: only rank 0 keeps the logits). ``sample`` on rank 0 samples as the base runner
    does, then broadcasts the tokens; on the other ranks it receives the tokens and records
    them in its rows.
    """

    @property
    def tp(self) -> TensorParallel:
        tp = self.model.tp
        if tp is None:
            raise ValueError("ParallelModelRunner needs a model built with a TensorParallel")
        return tp

    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput, grammar: GrammarOutput | None = None) -> SampledTokens:
        tp = self.tp
        if not fwd.sample_request_ids:
            return super().sample(fwd, None)  # no collective: every rank skips alike
        if tp.is_driver:
            sampled = super().sample(fwd, grammar)
            tokens = sampled.token_ids
            if tokens.dtype != torch.int64 or not tokens.is_contiguous():
                tokens = tokens.to(torch.int64).contiguous()
            with self.io.on_stream():
                tp.broadcast(tokens)
            return sampled
        with self.io.on_stream():
            n = len(fwd.sample_request_ids)
            tokens = torch.empty(n, dtype=torch.int64, device=self.io.device)
            tp.broadcast(tokens)
            self.states.append_sampled(fwd.sample_rows, fwd.sample_rows_device, tokens)
            return SampledTokens(
                fwd.request_ids,
                fwd.sample_request_ids,
                tokens,
                None,
                (None,) * n,
                HostCopy((tokens,)),
            )
