"""import_exllamav2 against a stand-in exllamav2 package written into tmp_path.

The real `import exllamav2` compiles CUDA, so the package here is a test double whose attn.py runs the
detection of 0.3.2's exllamav2/attn.py (lines 25-64) at import, as the real one does: the
EXLLAMA_NO_FLASH_ATTN check, `import flash_attn`, the version parse, `from flash_attn import ...`,
`import flash_attn_2_cuda`, and `except ModuleNotFoundError`. What it proves is ours: which provider
each setting gives, that exllamav2.attn keeps tokenspout's functions, and that nothing leaks after.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import textwrap

import pytest

from backend.config import AttentionSetting
from backend.engine import EngineUnavailable
from backend.exllamav2 import attention_provider, paged_attention
from backend.exllamav2.attention_provider import import_exllamav2

# exllamav2 0.3.2's attn.py detection, as the CPU stand-in for exllamav2 runs it (bench/gpu/rehearse.sh).
ATTN_PY = (pathlib.Path(__file__).resolve().parents[2] / "harness" / "stand_ins" / "exllamav2" / "attn.py").read_text()

# A flash-attn built for another torch or CUDA: its import fails with an ImportError that is not a
# ModuleNotFoundError, which 0.3.2's attn.py does not catch.
BROKEN_FLASH_ATTN = 'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'

WORKING_FLASH_ATTN = '''
__version__ = "2.7.4.post1"

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    raise AssertionError("not called here")

flash_attn_varlen_func = flash_attn_with_kvcache = flash_attn_func
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path holding the exllamav2 double; every module imported from it, and the
    record of the one import a process makes, are gone afterwards."""
    package = tmp_path / "exllamav2"
    package.mkdir()
    (package / "__init__.py").write_text("from exllamav2 import attn  # model.py imports it as the package loads\n")
    (package / "attn.py").write_text(textwrap.dedent(ATTN_PY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(attention_provider, "_imported", None)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("exllamav2", "flash_attn", "flash_attn_2_cuda"):
            del sys.modules[name]


@pytest.fixture
def no_flash_attn():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a flash_attn is installed in this environment")


def install(site, source: str, with_cuda: bool = False) -> None:
    (site / "flash_attn").mkdir()
    (site / "flash_attn" / "__init__.py").write_text(textwrap.dedent(source))
    if with_cuda:
        (site / "flash_attn_2_cuda.py").write_text("")
    importlib.invalidate_caches()


def test_sdpa_runs_exllamav2_paged_on_tokenspouts_functions_and_leaves_no_flash_attn_behind(site, no_flash_attn, monkeypatch):
    monkeypatch.setenv("EXLLAMA_NO_FLASH_ATTN", "1")  # would turn paged mode off, were it seen at import
    module, provider = import_exllamav2(AttentionSetting.SDPA)
    attn = sys.modules["exllamav2.attn"]
    assert (module.__name__, provider) == ("exllamav2", "sdpa")
    assert attn.has_flash_attn_with_paged and attn.has_flash_attn_with_window and attn.has_flash_attn_with_softcap
    assert attn.flash_attn_with_kvcache is paged_attention.flash_attn_with_kvcache
    assert attn.flash_attn_func is paged_attention.flash_attn_func
    assert attn.flash_attn_varlen_func is paged_attention.flash_attn_varlen_func
    # Nothing else (transformers asks find_spec) can see the stand-in, and the environment is as it was.
    assert "flash_attn" not in sys.modules and "flash_attn_2_cuda" not in sys.modules
    assert importlib.util.find_spec("flash_attn") is None
    assert os.environ["EXLLAMA_NO_FLASH_ATTN"] == "1"


def test_triton_runs_exllamav2_paged_on_the_kernel_for_kvcache_and_sdpa_for_the_rest(site, no_flash_attn):
    pytest.importorskip("triton")
    from backend.exllamav2 import paged_attention_triton

    module, provider = import_exllamav2(AttentionSetting.TRITON)
    attn = sys.modules["exllamav2.attn"]
    assert provider == "triton" and attn.has_flash_attn_with_paged
    assert attn.flash_attn_with_kvcache is paged_attention_triton.flash_attn_with_kvcache
    assert attn.flash_attn_func is paged_attention.flash_attn_func
    assert "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None


def test_triton_without_triton_installed_refuses_before_importing_exllamav2(site, no_flash_attn, monkeypatch):
    import backend.exllamav2

    monkeypatch.setitem(sys.modules, "backend.exllamav2.paged_attention_triton", None)  # as if triton were missing
    monkeypatch.delattr(backend.exllamav2, "paged_attention_triton", raising=False)
    with pytest.raises(EngineUnavailable, match="attention = triton needs the triton package") as refused:
        import_exllamav2("triton")
    assert "attention = sdpa" in str(refused.value)
    assert "exllamav2" not in sys.modules


def test_off_runs_exllamav2_unpaged_and_leaves_the_environment_as_it_was(site, monkeypatch):
    monkeypatch.delenv("EXLLAMA_NO_FLASH_ATTN", raising=False)
    _, provider = import_exllamav2("off")
    assert provider == "none" and not sys.modules["exllamav2.attn"].has_flash_attn_with_paged
    assert "EXLLAMA_NO_FLASH_ATTN" not in os.environ


def test_flash_attn_without_one_installed_refuses_to_start_and_names_sdpa(site, no_flash_attn):
    with pytest.raises(EngineUnavailable, match="flash-attn is not installed") as refused:
        import_exllamav2("flash-attn")
    assert "attention = sdpa" in str(refused.value)
    assert "exllamav2" not in sys.modules  # refused before the import, which compiles for minutes


def test_auto_without_flash_attn_installed_gives_sdpa(site, no_flash_attn):
    _, provider = import_exllamav2("auto")
    assert provider == "sdpa" and sys.modules["exllamav2.attn"].has_flash_attn_with_paged


def test_auto_with_a_broken_flash_attn_gives_sdpa_and_exllamav2_still_imports(site, no_flash_attn):
    install(site, BROKEN_FLASH_ATTN)
    with pytest.raises(ImportError):  # what 0.3.2's own import would have died of
        importlib.import_module("flash_attn")
    module, provider = import_exllamav2("auto")
    assert provider == "sdpa" and module.attn.flash_attn_with_kvcache is paged_attention.flash_attn_with_kvcache
    assert "flash_attn" not in sys.modules  # neither the stand-in nor the broken one


def test_auto_with_a_working_paged_flash_attn_uses_it(site, no_flash_attn):
    install(site, WORKING_FLASH_ATTN, with_cuda=True)
    module, provider = import_exllamav2("auto")
    assert provider == "flash-attn" and module.attn.flash_attn_with_kvcache is sys.modules["flash_attn"].flash_attn_func


def test_a_second_import_with_a_conflicting_setting_is_refused(site, no_flash_attn):
    first, provider = import_exllamav2("sdpa")
    again, same = import_exllamav2("auto")  # content with whatever was imported
    assert (again, same) == (first, provider)
    assert import_exllamav2("sdpa")[1] == "sdpa"
    with pytest.raises(EngineUnavailable, match="already imported with sdpa"):
        import_exllamav2("off")
    with pytest.raises(EngineUnavailable, match="already imported with sdpa"):
        import_exllamav2("flash-attn")
    with pytest.raises(EngineUnavailable, match="already imported with sdpa"):
        import_exllamav2("triton")


def test_the_start_line_names_the_provider_and_whether_it_batches():
    assert attention_provider.describe("sdpa", True, 8) == (
        "exllamav2 attention: sdpa (tokenspout's paged attention on torch SDPA), paged, batch 8")
    assert attention_provider.describe("triton", True, 64) == (
        "exllamav2 attention: triton (tokenspout's paged attention kernel, each page read once), paged, batch 64")
    assert attention_provider.describe("none", False, 1) == "exllamav2 attention: none, unpaged, one request at a time"
