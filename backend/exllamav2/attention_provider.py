"""Which attention exllamav2 runs on, settled when it is imported.

exllamav2 0.3.2 decides at import (exllamav2/attn.py, module globals) whether it may run paged:
only when `import flash_attn` gives version >= 2.5.7 with `flash_attn_with_kvcache` and
`flash_attn_2_cuda` imports too. PyPI has no such wheel for current torch and CUDA, so `sdpa` and
`triton` lend it tokenspout's own provider under the name `flash_attn`, for the length of the import
only: exllamav2.attn keeps the functions it took, and no other library (transformers looks for
flash_attn by its spec) ever finds the stand-in afterwards. Both take flash_attn_func and
flash_attn_varlen_func (unpaged) from backend.exllamav2.paged_attention; flash_attn_with_kvcache,
every paged forward, comes from there (`sdpa`: pages gathered, then SDPA) or from
backend.exllamav2.paged_attention_triton (`triton`: a kernel that reads each page once).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from backend.config import AttentionSetting
from backend.engine import EngineUnavailable

log = logging.getLogger(__name__)

FLASH_ATTN = "flash-attn"
SDPA = "sdpa"
TRITON = "triton"
NONE = "none"
STAND_IN_VERSION = "2.8.3"
"""The flash-attn version the stand-in claims: past 2.5.7, so exllamav2 enables paged mode."""
_STAND_IN_NAMES = ("flash_attn", "flash_attn_2_cuda")

_imported: tuple[AttentionSetting, str] | None = None
"""The setting exllamav2 was imported under, and the provider that gave: one per process."""


def import_exllamav2(setting: AttentionSetting | str) -> tuple[types.ModuleType, str]:
    """exllamav2 imported with the attention `setting` asks for, and the provider's name
    (`flash-attn`, `sdpa`, `triton` or `none`). A process imports exllamav2 once: a later call with another
    setting that would need another provider raises EngineUnavailable."""
    global _imported
    setting = AttentionSetting(setting)
    if _imported is not None:
        provider = _imported[1]
        if _provider_for(setting, provider) != provider:
            raise EngineUnavailable(f"exllamav2.attention {setting}: exllamav2 was already imported with {provider}")
        return sys.modules["exllamav2"], provider
    if setting is AttentionSetting.AUTO:
        problem = flash_attn_problem()
        setting = AttentionSetting.SDPA if problem else AttentionSetting.FLASH_ATTN
        if problem:
            log.info("exllamav2 attention: %s; using sdpa", problem)
    if setting is AttentionSetting.FLASH_ATTN:
        problem = flash_attn_problem()
        if problem:
            raise EngineUnavailable(
                f"attention = flash-attn: {problem}; install flash-attn >= 2.5.7 built for this torch and CUDA, "
                "or set attention = sdpa (tokenspout's paged attention, which needs none) or auto"
            )
        module = _import_with_env(no_flash_attn=False)
    elif setting is AttentionSetting.SDPA:
        with _stand_in_flash_attn(_sdpa_kvcache()):
            module = _import_with_env(no_flash_attn=False)
    elif setting is AttentionSetting.TRITON:
        with _stand_in_flash_attn(_triton_kvcache()):
            module = _import_with_env(no_flash_attn=False)
    else:
        module = _import_with_env(no_flash_attn=True)
    # What exllamav2 made of it: `auto` is settled by now, and only a paged import has a provider.
    paged = bool(importlib.import_module("exllamav2.attn").has_flash_attn_with_paged)
    provider = _provider_for(setting, NONE) if paged else NONE
    _imported = (setting, provider)
    return module, provider


def describe(provider: str, paged: bool, batch: int) -> str:
    """The start-up line naming the attention exllamav2 runs on, and what it allows."""
    names = {FLASH_ATTN: "flash-attn", SDPA: "sdpa (tokenspout's paged attention on torch SDPA)",
             TRITON: "triton (tokenspout's paged attention kernel, each page read once)", NONE: "none"}
    mode = f"paged, batch {batch}" if paged else "unpaged, one request at a time"
    return f"exllamav2 attention: {names.get(provider, provider)}, {mode}"


def flash_attn_problem() -> str:
    """Why the installed flash-attn cannot run exllamav2 paged, or "" when it can. Checked in
    isolation first: a flash_attn that fails to import would otherwise break `import exllamav2`."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    try:
        flash_attn = importlib.import_module("flash_attn")
        version = [int(part) for part in str(flash_attn.__version__).split(".") if part.isdigit()]
        importlib.import_module("flash_attn_2_cuda")
    except Exception as exc:  # built for another torch or CUDA: any error at all
        return f"flash-attn does not import ({type(exc).__name__}: {exc})"
    if version < [2, 5, 7] or not hasattr(flash_attn, "flash_attn_with_kvcache"):
        return f"flash-attn {flash_attn.__version__} has no paged kvcache (needs >= 2.5.7)"
    return ""


def _provider_for(setting: AttentionSetting, current: str) -> str:
    """The provider `setting` needs (`auto` is content with the current one)."""
    return {
        AttentionSetting.FLASH_ATTN: FLASH_ATTN, AttentionSetting.SDPA: SDPA, AttentionSetting.TRITON: TRITON,
        AttentionSetting.OFF: NONE,
    }.get(setting, current)


KvcacheFunction = Callable[..., Any]


def _sdpa_kvcache() -> KvcacheFunction:
    from backend.exllamav2 import paged_attention

    return paged_attention.flash_attn_with_kvcache


def _triton_kvcache() -> KvcacheFunction:
    """The kernel's entry point; EngineUnavailable, before exllamav2's import, where triton is missing."""
    try:
        from backend.exllamav2 import paged_attention_triton
    except ImportError as exc:
        raise EngineUnavailable(
            f"attention = triton needs the triton package ({exc}); CUDA builds of torch install it, "
            "or set attention = sdpa"
        ) from exc
    return paged_attention_triton.flash_attn_with_kvcache


def _import_with_env(no_flash_attn: bool) -> types.ModuleType:
    """Imports exllamav2 and its attention module; EXLLAMA_NO_FLASH_ATTN (read by attn.py at import)
    is set only for the import and restored after, so the process's environment stays as it was."""
    before = os.environ.get("EXLLAMA_NO_FLASH_ATTN")
    if no_flash_attn:
        os.environ["EXLLAMA_NO_FLASH_ATTN"] = "1"
    elif before is not None:
        del os.environ["EXLLAMA_NO_FLASH_ATTN"]
    try:
        module = importlib.import_module("exllamav2")
        importlib.import_module("exllamav2.attn")
        return module
    finally:
        if before is None:
            os.environ.pop("EXLLAMA_NO_FLASH_ATTN", None)
        else:
            os.environ["EXLLAMA_NO_FLASH_ATTN"] = before


@contextlib.contextmanager
def _stand_in_flash_attn(kvcache: KvcacheFunction) -> Iterator[None]:
    """`flash_attn` and `flash_attn_2_cuda` in sys.modules backed by tokenspout's provider (its
    flash_attn_with_kvcache `kvcache`), then whatever was there before (usually nothing) put back."""
    from backend.exllamav2 import paged_attention

    saved = {name: sys.modules.get(name) for name in _STAND_IN_NAMES}
    flash_attn = types.ModuleType("flash_attn", "tokenspout's paged attention standing in for flash-attn")
    flash_attn.__version__ = STAND_IN_VERSION  # type: ignore[attr-defined]
    flash_attn.flash_attn_func = paged_attention.flash_attn_func  # type: ignore[attr-defined]
    flash_attn.flash_attn_varlen_func = paged_attention.flash_attn_varlen_func  # type: ignore[attr-defined]
    flash_attn.flash_attn_with_kvcache = kvcache  # type: ignore[attr-defined]
    # attn.py imports it but only the tensor-parallel C++ path uses it, which one GPU never takes.
    cuda = types.ModuleType("flash_attn_2_cuda", "empty: exllamav2 imports it, one GPU never calls it")
    sys.modules.update(flash_attn=flash_attn, flash_attn_2_cuda=cuda)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
