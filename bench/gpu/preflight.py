"""What the GPU check runs on, and whether exllamav2's extension could be compiled here, before anything is built.

Writes the versions first (Python, gcc, nvcc, torch, the driver and GPU), then finds the real CUDA
root and every header the extension's sources include, and prints shell `export` lines that make
torch's extension builder use them:

    python3 bench/gpu/preflight.py --report preflight.txt --env-file cuda.env   # then: source cuda.env

Why each step: torch's builder takes CUDA_HOME from `which nvcc` when the variable is unset, and a
wrapper script such as /usr/local/bin/nvcc gives it the wrong root; NVIDIA's pip packages keep the
cuBLAS/cuSPARSE/CCCL headers in site-packages/nvidia/cu13/include, which torch never searches; and
the link step wants an unversioned libcudart.so that those packages do not ship. Without `nv/target`
every .cpp stops at its first include, without cusparse.h every file that includes ATen/cuda does.

Exit status 0: a JIT build has everything it needs; 1: something is missing (the report says what).
Nothing here needs a GPU, and it never imports exllamav2 (that import would start the build).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

# Headers the extension's sources reach, directly or through torch's ATen/cuda headers.
NEEDED_HEADERS = {
    "cuda_runtime.h": "CUDA runtime",
    "cuda_fp16.h": "CUDA half types",
    "crt/host_config.h": "nvcc's CRT",
    "nv/target": "CCCL (libcu++)",
    "cublas_v2.h": "cuBLAS",
    "cublasLt.h": "cuBLASLt",
    "cusparse.h": "cuSPARSE",
}
NEEDED_LIBRARIES = ("libcudart.so",)  # torch's builder links with -lcudart


def run(*command: str, timeout: float = 30) -> str:
    """A tool's output, or why there is none (a missing tool is a finding, not a crash)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable ({type(error).__name__}: {error})"
    output = (done.stdout + done.stderr).strip()
    return output if done.returncode == 0 else f"failed with {done.returncode}: {output[-300:]}"


def first_line_with(text: str, word: str) -> str:
    return next((line.strip() for line in text.splitlines() if word in line), text.splitlines()[0] if text else "")


def torch_facts() -> dict[str, str]:
    """torch's version, its CUDA, its C++ ABI, whether it sees a GPU: read in a child, so a broken torch is one line."""
    probe = (
        "import torch;"
        "print(torch.__version__); print(torch.version.cuda); print(int(torch._C._GLIBCXX_USE_CXX11_ABI));"
        "print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no')"
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"torch": f"unavailable ({type(error).__name__})"}
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) < 4:
        return {"torch": "not importable: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return dict(zip(("torch", "torch CUDA", "torch CXX11 ABI", "torch sees a GPU"), lines[-4:]))


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def nvcc_root(nvcc: str) -> pathlib.Path | None:
    """The toolkit root nvcc itself uses: its --dryrun names it as TOP, through any wrapper script."""
    dryrun = run(nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null")
    match = re.search(r"^#\$ TOP=(.+)$", dryrun, re.MULTILINE)
    if match:
        return pathlib.Path(match.group(1).strip()).resolve()
    resolved = pathlib.Path(nvcc).resolve()
    return resolved.parent.parent if resolved.parent.name == "bin" else None


def find_cuda_home(environ_home: str | None) -> tuple[pathlib.Path | None, str]:
    """CUDA_HOME if it holds nvcc, else the root of the nvcc on PATH, else a pip-installed nvcc."""
    if environ_home and (pathlib.Path(environ_home) / "bin" / "nvcc").exists():
        return pathlib.Path(environ_home).resolve(), "CUDA_HOME as given"
    on_path = shutil.which("nvcc")
    if on_path:
        root = nvcc_root(on_path)
        if root and (root / "bin" / "nvcc").exists():
            return root, f"the toolkit of {on_path}"
    for include_dir in pip_include_dirs():
        root = include_dir.parent
        if (root / "bin" / "nvcc").exists():
            return root, "NVIDIA's pip packages"
    return None, "no nvcc on PATH, in CUDA_HOME or in NVIDIA's pip packages"


def pip_include_dirs() -> list[pathlib.Path]:
    """Where NVIDIA's pip packages keep headers: nvidia/cu13/include (CUDA 13), nvidia/*/include (CUDA 12)."""
    found = []
    for site in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]):
        nvidia = pathlib.Path(site or ".") / "nvidia"
        if nvidia.is_dir():
            found += sorted(p for p in nvidia.glob("*/include") if p.is_dir())
    return list(dict.fromkeys(found))


def include_candidates(cuda_home: pathlib.Path | None) -> list[pathlib.Path]:
    dirs = []
    if cuda_home:
        dirs += [cuda_home / "include", cuda_home / "targets" / "x86_64-linux" / "include"]
    return [d for d in dict.fromkeys(dirs + pip_include_dirs()) if d.is_dir()]


def library_candidates(cuda_home: pathlib.Path | None) -> list[pathlib.Path]:
    dirs = [cuda_home / "lib64", cuda_home / "lib"] if cuda_home else []
    dirs += [d.parent / "lib" for d in pip_include_dirs()]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def locate(name: str, dirs: list[pathlib.Path]) -> pathlib.Path | None:
    return next((d for d in dirs if (d / name).exists()), None)


def link_dir_for(library: str, dirs: list[pathlib.Path], scratch: pathlib.Path) -> pathlib.Path | None:
    """A directory holding `library` (libcudart.so): as found, or a link to its versioned file in scratch."""
    found = locate(library, dirs)
    if found:
        return found
    versioned = next((v for d in dirs for v in sorted(d.glob(library + ".[0-9]*"))), None)
    if versioned is None:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    link = scratch / library
    link.unlink(missing_ok=True)
    link.symlink_to(versioned)
    return scratch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=pathlib.Path, required=True, help="where to write what was found")
    parser.add_argument("--env-file", type=pathlib.Path, required=True, help="shell exports for the build")
    parser.add_argument("--scratch", type=pathlib.Path, default=pathlib.Path("/tmp/tokenspout-gpu/cuda-links"))
    args = parser.parse_args()

    lines: list[str] = []

    def say(key: str, value: object) -> None:
        lines.append(f"{key:<22} {value}")
        print(lines[-1], flush=True)
        args.report.write_text("\n".join(lines) + "\n")  # written as it goes: a hang later keeps the rest

    # Versions first, so they are in the report whatever happens after.
    say("python", f"{sys.version.split()[0]} ({sys.executable})")
    say("gcc", first_line_with(run("gcc", "--version"), "gcc"))
    say("nvcc on PATH", shutil.which("nvcc") or "none")
    say("nvcc", first_line_with(run("nvcc", "--version"), "release"))
    smi = run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader")
    say("GPU, driver", smi)
    for key, value in torch_facts().items():
        say(key, value)
    for package in ("exllamav2", "transformers", "tokenizers", "safetensors", "numpy", "ninja", "grpcio"):
        say(package, package_version(package))

    problems = []
    cuda_home, how = find_cuda_home(os.environ.get("CUDA_HOME"))
    say("CUDA_HOME", f"{cuda_home or 'NOT FOUND'} ({how})")
    if cuda_home is None:
        problems.append("no CUDA toolkit (nvcc)")
    else:
        say("its nvcc", first_line_with(run(str(cuda_home / "bin" / "nvcc"), "--version"), "release"))
    if not shutil.which("ninja"):
        problems.append("no ninja")

    includes = include_candidates(cuda_home)
    used_includes = []
    for header, what in NEEDED_HEADERS.items():
        where = locate(header, includes)
        say(f"header {header}", where or f"MISSING ({what})")
        if where is None:
            problems.append(f"{header} ({what})")
        elif where not in used_includes:
            used_includes.append(where)
    libraries = library_candidates(cuda_home)
    used_libraries = []
    for library in NEEDED_LIBRARIES:
        where = link_dir_for(library, libraries, args.scratch)
        say(f"library {library}", where or "MISSING")
        if where is None:
            problems.append(library)
        elif where not in used_libraries:
            used_libraries.append(where)

    exports = []
    if cuda_home:
        exports.append(f"export CUDA_HOME={shlex.quote(str(cuda_home))}")
        exports.append(f'export PATH={shlex.quote(str(cuda_home / "bin"))}:"$PATH"')
    if used_includes:  # CPATH reaches both gcc and nvcc's host pass; torch passes only CUDA_HOME/include itself
        joined = ":".join(str(d) for d in used_includes)
        exports.append(f'export CPATH={shlex.quote(joined)}"${{CPATH:+:$CPATH}}"')
    if used_libraries:
        joined = ":".join(str(d) for d in used_libraries)
        exports.append(f'export LIBRARY_PATH={shlex.quote(joined)}"${{LIBRARY_PATH:+:$LIBRARY_PATH}}"')
    args.env_file.write_text("\n".join(exports) + "\n")
    verdict = "JIT build impossible: missing " + ", ".join(problems) if problems else "a JIT build has what it needs"
    say("verdict", verdict)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
