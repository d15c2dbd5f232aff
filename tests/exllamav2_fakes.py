"""Fakes of exllamav2's generator API (0.3.2) for the engine's CPU-side tests: scripted result
dicts per iterate(), recorded enqueue and cancel calls, and the job factory ExLlamaV2Core takes."""

from __future__ import annotations

from backend.exllamav2.jobs import job_fields
from backend.types import GenerationRequest

EOS = (2,)


class FakeJob:
    def __init__(self, request: GenerationRequest) -> None:
        self.identifier = request.request_id
        self.fields = job_fields(request, EOS)


class FakeGenerator:
    """Scripted results per iterate(); records enqueue and cancel calls."""

    def __init__(self) -> None:
        self.script: list[list[dict]] = []
        self.enqueued: list[FakeJob] = []
        self.cancelled: list[FakeJob] = []
        self.refuse = False
        self.explode = False

    def enqueue(self, job: FakeJob) -> int:
        assert not self.refuse, "Job requires 33 pages (only 32 available) and cannot be enqueued"
        self.enqueued.append(job)
        return len(self.enqueued)

    def cancel(self, job: FakeJob) -> None:
        self.cancelled.append(job)  # exllamav2 emits no result for a cancelled job

    def iterate(self) -> list[dict]:
        if self.explode:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.script.pop(0) if self.script else []


class FakeGenerators(list):
    """ExLlamaV2Core's make_generator: each call makes (and keeps) a FakeGenerator, or fails while `failing`."""

    failing = False

    def __call__(self) -> FakeGenerator:
        if self.failing:
            raise RuntimeError("CUDA out of memory")
        self.append(FakeGenerator())
        return self[-1]


class FakeJobs:
    """ExLlamaV2Core's make_job: a FakeJob, with the grammar filter core a test assigns to its request id."""

    def __init__(self) -> None:
        self.constraints: dict = {}

    def __call__(self, request: GenerationRequest):
        if request.request_id == "explode":
            raise TypeError("Settings.__init__() got an unexpected keyword argument")
        return FakeJob(request), self.constraints.get(request.request_id)


def streaming(identifier: str, ids: list[int] | None = None, text: str | None = None, **extra) -> dict:
    result = {"job": None, "stage": "streaming", "eos": False, "serial": 1, "identifier": identifier}
    if ids is not None:
        result["token_ids"] = [ids]
    if text is not None:
        result["text"] = text
    result.update(extra)
    return result


def eos(identifier: str, reason: str, new_tokens: int, **extra) -> dict:
    return streaming(identifier, eos=True, eos_reason=reason, new_tokens=new_tokens, prompt_tokens=3,
                     time_enqueued=0.01, time_prefill=0.02, time_generate=0.3, cached_tokens=0,
                     full_completion="", **extra)
