"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from baton.engine.models.attention import (
    AttentionMetadata,
    StepMetadata,
    layer_metadata,
    sdpa_backends,
)
from baton.engine.models.config import ModelConfig
from baton.engine.models.cpu_decode import FusedLayer, attention_isa, fused_layers, step_fits
from baton.engine.models.decoder_layer import DecoderLayer, make_linear
from baton.engine.models.gguf_linear import (
    EMBEDDING,
    LM_HEAD,
    QuantParts,
    expert_projections,
    layer_projections,
)
from baton.engine.models.kv_cache import KVCache
from baton.engine.models.layers import RMSNorm, RotaryEmbedding, dense_linear
from baton.engine.models.packed import (
    PackedWeight,
    pack_and_release,
    pack_linear,
    packed_linear,
)
from baton.engine.models.parallel import TensorParallel, VocabParallelEmbedding
from baton.engine.models.quant import (
    Int8Weight,
    check_int8_weight,
    int8_linear,
    quantize_and_release,
    quantize_int8,
)
from baton.engine.models.sharding import shard_config
from baton.engine.models.weight_loading import load_decoder_weights
from baton.kernels.quant_formats import QuantWeight
from baton.kernels.quant_linear import QuantProjection, dequantize_rows_native


def _embedding(
    config: ModelConfig, local: ModelConfig, tp: TensorParallel | None, quantized: bool
) -> nn.Module:
    """The token embedding: this rank's vocabulary shard under tensor parallelism. With
    quantised weights (a GGUF model) it is not allocated here but takes the loaded tensor
    itself (``load_weights``): a float32 table built and then cast was the largest transient
    of the build (the default model's: 108 + 54 MiB)."""
    if tp is not None:
        return VocabParallelEmbedding(local.vocab_size, config.hidden_size, tp)
    return nn.Embedding(
        config.vocab_size,
        config.hidden_size,
        # Given a meta weight, no random init: normal_ on a meta tensor imported
        # torch._dynamo (1.3-1.8 s of every GGUF load).
        _weight=torch.empty(config.vocab_size, config.hidden_size, device="meta")
        if quantized
        else None,
    )


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; weights come from ``load_weights``.

    ``forward`` takes a flat batch (prefill chunks and decode tokens mixed) and
    returns hidden states; ``compute_logits`` turns only the rows that sample
    into logits.

    With ``tp`` (tensor parallelism) the model holds this rank's shard (``local_config``, cut
    as ``sharding.py`` says, weights from ``sharding.shard_weights``) and meets the other
    ranks in ``tp``'s collectives; ``config`` stays the whole model's.

    ``quantized``: GGUF-quantised linear weights (``Checkpoint.quantized``, named as
    ``models/gguf_linear.py`` says), multiplied by ``kernels/quant_linear.py`` on every step;
    the modules they replace get no dense weight, and ``load_weights`` then takes the rest.

    Raises:
        ValueError: ``quantized`` with ``tp``, or a projection quantised only in part.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel | None = None,
        quantized: Mapping[str, QuantWeight] | None = None,
        quant_activations: str = "float32",
    ) -> None:
        super().__init__()
        quantized = quantized or {}
        self.quant_activations = quant_activations
        if quantized and tp is not None:
            raise ValueError("GGUF-quantised weights cannot be cut for tensor parallelism yet")
        self.config = config
        self.tp = tp
        local = config if tp is None else shard_config(config, tp.size)
        self.local_config = local
        self.embed_tokens = _embedding(config, local, tp, bool(quantized))
        reduce = None if tp is None else tp.all_reduce
        self.layers = nn.ModuleList(
            self.build_layer(
                i,
                local,
                reduce,
                layer_projections(quantized, i) if quantized else None,
                quant_activations,
                expert_projections(quantized, i, config.num_experts)
                if quantized and config.moe_layer(i)
                else None,
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self._init_head(config, local, quantized, quant_activations)
        self.requires_grad_(False)
        # The LM head as int8 weights (set by ``quantize_int8``).
        self.lm_head_int8: Int8Weight | None = None
        # The LM head packed for oneDNN (set by ``pack_weights``).
        self.lm_head_packed: PackedWeight | None = None
        # The dense linears through the batch-invariant kernel (``set_invariant_gemm``).
        self.invariant_gemm = False

    def _init_head(
        self,
        config: ModelConfig,
        local: ModelConfig,
        quantized: Mapping[str, QuantWeight],
        quant_activations: str,
    ) -> None:
        """The LM head (dense, or its GGUF blocks and kernel call), a GGUF embedding's blocks,
        and the fused CPU decode's state."""
        # The LM head in GGUF blocks (tied or not): then every step multiplies with it.
        self.lm_head_quant: QuantWeight | None = quantized.get(LM_HEAD)
        # The layers' fused CPU decode calls (``_fused_layers``): built on the first step that
        # could take them; _fusable turns False where a layer cannot.
        self._fused: tuple[FusedLayer, ...] | None = None
        self._fusable = bool(quantized)
        # False: every step runs the layers' own forward (for side-by-side measurements and
        # the test that the two give the same bits).
        self.fuse_cpu_decode = True
        self._lm_head_call = (
            None
            if self.lm_head_quant is None
            else QuantProjection((self.lm_head_quant,), activations=quant_activations)
        )
        # The embedding in GGUF blocks, its own (EMBEDDING) or a tied head's: then lookups
        # decode its rows and no dense table is held (an empty weight stands in).
        self.embed_quant: QuantWeight | None = quantized.get(EMBEDDING) or (
            self.lm_head_quant if config.tie_word_embeddings else None
        )
        if self.embed_quant is not None:
            self.embed_tokens.weight = nn.Parameter(
                torch.empty(0, config.hidden_size), requires_grad=False
            )
        self.lm_head: nn.Linear | None = (
            None
            if config.tie_word_embeddings
            else make_linear(
                config.hidden_size, local.vocab_size, False, self.lm_head_quant is not None
            )
        )

    def build_layer(
        self,
        index: int,
        config: ModelConfig,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None,
        quant: tuple[QuantParts | None, ...] | None,
        quant_activations: str,
        experts: tuple[tuple[QuantParts, QuantParts], ...] | None = None,
    ) -> DecoderLayer:
        """Decoder layer ``index`` of this model (``config``: the rank's shard shape; ``quant``,
        ``experts``: its GGUF-quantised projections and experts); a subclass with another
        block overrides it (``models/gemma.py``)."""
        return DecoderLayer(
            config,
            reduce,
            quant,
            quant_activations,
            moe=self.config.moe_layer(index),
            window=self.config.layer_window(index),
            experts=experts,
        )

    def quantize_int8(self) -> None:
        """Replaces every linear layer's weight (LM head included) by int8 weight-only ones
        (per-output-channel scales, ``quant.py``), used by every step whatever its row count;
        the projections' and an untied LM head's dense weights are released (a tied head's
        embedding stays for lookups). Call after the weights are loaded and the model has
        its final dtype, on the CPU, instead of ``pack_weights``.

        Raises:
            ValueError: the model is not on the CPU, is quantised or packed already, is a
                mixture of experts, or has a linear layer the int8 kernel cannot take (nothing is
                changed then).
        """
        if self.embed_tokens.weight.device.type != "cpu":
            raise ValueError("int8 weight-only kernels run on the CPU only")
        if self.lm_head_int8 is not None:
            raise ValueError("the model's weights are int8 already")
        self._refuse_if_gguf("int8")
        if self.config.is_moe:
            raise ValueError(
                "quantization='int8' does not cover a mixture-of-experts model's experts yet; "
                "use quantization=None"
            )
        if self.lm_head_packed is not None:
            raise ValueError("the model's weights are packed already; int8 replaces packing")
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # Every shape first, so that a refusal leaves the model whole.
        for layer in self.layers:
            for linear in layer._linears:
                check_int8_weight(linear.weight)
        check_int8_weight(head)
        for layer in self.layers:
            layer.quantize_int8()
        self.lm_head_int8 = (
            quantize_int8(head, head.dtype)  # tied: the embedding stays for lookups
            if self.lm_head is None
            else quantize_and_release(self.lm_head)
        )

    def pack_weights(self, batch_invariant: bool = True) -> None:
        """Packs every linear layer's weight (LM head included) for oneDNN and uses the packed
        weights for every step; the projections' and an untied LM head's dense weights are
        released (the embedding stays), a mixture of experts' router and experts too. Call
        after the weights are loaded and the model has its final dtype (CPU).
        ``batch_invariant``: lone rows padded where a GEMM would reduce them in another
        order (``pack_linear``).

        Raises:
            ValueError: the model is not on the CPU, packed already or quantised
                (``quantize_int8``), or its dtype cannot be packed
                (``packed.packing_available``).
        """
        if self.embed_tokens.weight.device.type != "cpu":
            raise ValueError("packed weights are for the CPU only")
        if self.lm_head_packed is not None:
            raise ValueError("the model's weights are packed already")
        if self.lm_head_int8 is not None:
            raise ValueError("the model's weights are int8; there is no dense weight to pack")
        self._refuse_if_gguf("packing")
        for layer in self.layers:
            layer.pack_weights(batch_invariant)
        self.lm_head_packed = (
            # tied: the embedding stays for lookups
            pack_linear(self.embed_tokens.weight, None, batch_invariant)
            if self.lm_head is None
            else pack_and_release(self.lm_head, batch_invariant)
        )

    def set_batch_invariant(self, on: bool) -> None:
        """Whether the CPU attends prefill and mixed steps token by token, in the order a
        decode step of each token's length would (``paged_attention(token_order=True)``; the
        default), or through the padded SDPA (at most a few percent faster on long prompts:
        ``EngineConfig.batch_invariant``). Lone rows' padding is ``pack_weights``'s. On CUDA
        this leaves the linears on cuBLAS: the batch-invariant kernel (``set_invariant_gemm``)
        is only switched on by the GPU check until that check has measured its cost on a GPU.
        """
        for layer in self.layers:
            layer.token_order = on

    def set_invariant_gemm(self, on: bool) -> None:
        """Whether every dense linear (projections, a mixture of experts' router and experts,
        the LM head) runs on ``kernels/invariant_matmul.py``, which gives a row the same bits
        whatever else its step holds, instead of ``F.linear`` (cuBLAS on CUDA picks its kernel
        by the row count). Packed, int8 and GGUF-quantised linears keep their kernels. Set by
        the GPU check (``bench/gpu/invariance_check.py``), not by the engine yet: the kernel has
        not run on a GPU, and its cost against cuBLAS is what that check measures. It runs on
        CPU tensors only under the Triton interpreter (the tests)."""
        self.invariant_gemm = on
        for layer in self.layers:
            layer.invariant_gemm = on
            if layer.mlp is not None:
                layer.mlp.invariant_gemm = on

    @property
    def gguf_quantized(self) -> bool:
        """Whether any linear weight is held in GGUF blocks (``quantized``)."""
        return self.lm_head_quant is not None or any(
            layer.quant is not None or (layer.mlp is not None and layer.mlp.quant_calls is not None)
            for layer in self.layers
        )

    def _refuse_if_gguf(self, what: str) -> None:
        if self.gguf_quantized:
            raise ValueError(f"the model's weights are GGUF-quantised; {what} needs dense ones")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCache,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Runs the decoder on flat tokens; writes their keys/values into ``kv_caches``.
        ``meta``: one for all layers, or each layer's (KV cache groups).

        Returns hidden states ``[T, hidden_size]`` after the final norm.
        """
        x = self.embed(input_ids)
        rope = self.rope.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        metas = layer_metadata(meta, len(self.layers))
        # The fused decode keeps to one metadata for every layer (no groups).
        fused = self._fused_layers(x, rope, kv_caches, meta) if meta is metas[0] else None
        if fused is not None:  # a CPU decode step: one C++ call a layer, the same bits
            isa = attention_isa()
            for call, kv in zip(fused, kv_caches, strict=True):
                x, residual = call(x, residual, rope, kv, meta, isa)
            return self.norm.forward_add(x, residual)[0]
        with sdpa_backends(x.device):
            for layer, kv, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
                x, residual = layer(x, residual, rope, kv, layer_meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.forward_add(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows ``[T, hidden]`` of ``input_ids``, in the model's dtype (decoded
        from GGUF blocks where the table is held so)."""
        if self.embed_quant is None:
            return self.embed_tokens(input_ids)
        return dequantize_rows_native(self.embed_quant, input_ids).to(self.norm.weight.dtype)

    def _fused_layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[FusedLayer, ...] | None:
        """The layers' fused CPU decode calls (``models/cpu_decode.py``) when this step takes
        them, else None. Built on the first step that could (after the weights are loaded);
        None for good where a layer cannot fuse."""
        if not (self._fusable and self.fuse_cpu_decode and kv_caches):
            return None
        if not step_fits(x, rope, kv_caches[0], meta, self.norm.weight.dtype):
            return None
        if self._fused is None:
            self._fused = fused_layers(self.layers)
            self._fusable = self._fused is not None
        return self._fused

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for the given hidden rows, written into ``out``
        (float32 ``[N, vocab]``) when given. Under tensor parallelism only rank 0 gets them;
        the other ranks send their vocabulary slice and get it back (``out`` is not taken
        there).

        Raises:
            ValueError: ``out`` under tensor parallelism.
        """
        if self._lm_head_call is not None:
            logits = self._lm_head_call(hidden)
        elif self.lm_head_int8 is not None:
            logits = int8_linear(hidden, self.lm_head_int8)
        elif self.lm_head_packed is not None:
            logits = packed_linear(hidden, self.lm_head_packed)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = dense_linear(hidden, weight, None, self.invariant_gemm)
        if self.tp is None:
            return logits.float() if out is None else out.copy_(logits)
        if out is not None:
            raise ValueError("compute_logits takes no out= under tensor parallelism")
        return self.tp.gather_logits(logits.float(), self.config.vocab_size)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face-named weights in, fusing QKV and gate/up; the weights of linears
        built GGUF-quantised (``quantized``) are not taken (nor expected)
        (``weight_loading.load_decoder_weights``).

        Raises:
            ValueError: naming any missing, unexpected or wrongly shaped weight.
        """
        load_decoder_weights(self, weights)
