"""What the Triton kernel tests share: building a kernel's sm_90 cubin without a GPU."""

from __future__ import annotations

from typing import Any


def hopper_cubin(
    fn: Any,
    pointer_type: str,
    constexprs: dict[str, Any],
    scalar_types: dict[str, str] | None = None,
    num_warps: int = 4,
    options: dict[str, Any] | None = None,
    asm: str = "cubin",
) -> Any:
    """The sm_90 cubin of the jitted kernel ``fn``: its ``*_ptr`` arguments typed
    ``pointer_type`` (e.g. "*bf16"), the ``constexprs`` given, other arguments "i32", unless
    ``scalar_types`` names them (a pointer too: ``{"slot_ptr": "*i64"}``). The interpreter
    accepts things the compiler rejects; this compiles as a launch would, with no GPU.
    ``options`` are further launch options (they
    override ``num_warps``); ``asm="ptx"`` returns the PTX text instead. Point
    TRITON_CACHE_DIR at a temporary folder first (``monkeypatch.setenv``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    types = scalar_types or {}
    signature = {
        name: "constexpr"
        if name in constexprs
        else types.get(name, pointer_type if name.endswith("_ptr") else "i32")
        for name in fn.arg_names
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = compile(
        source,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, **(options or {})},
    )
    return compiled.asm[asm]
