"""Every example in README.md and docs/*.md, taken from the pages (tests/harness/doc_examples.py) and run as a
reader runs it, in the page's order, against live servers on the embedded model: grpcurl and shell
commands, the `tokenspout-client` CLI, the Python and TypeScript snippets, and the servers the pages start.
Each gives what its page says, with text: a console block's command prints the lines the page shows, and the
checks below hold what the prose around the others promises. An example whose output is sampled at random
runs RUNS times. Examples the build machines cannot run (a GPU, Docker, a cluster) say why, and a new example
without a check fails the first test, so none is left untested by accident."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import re
from collections.abc import Callable

import jsonschema
import pytest

from tests.harness.doc_examples import PAGES, Example, PageSession, Ran, compile_typescript, examples, shown_in
from tests.harness.proxies import free_port
from tests.harness.servers import REPORT, ROOT
from tests.service.test_grpcurl import json_stream

RUNS = 10
"""How often an example that samples at random runs: each run must give what the page says."""
GPU = "needs an NVIDIA GPU (bench/gpu/run.sh runs this path on a lent one)"
NO_CLUSTER = "no cluster here: the manifests are rendered and validated (tests/deploy)"
NO_DOCKER = "no Docker engine here: the image is linted (tests/deploy)"


# -- what the pages promise ---------------------------------------------------------------------------------


def succeeded(ran: Ran) -> None:
    assert ran.returncode == 0, ran.output


def messages_of(ran: Ran) -> list[dict]:
    succeeded(ran)
    return json_stream(ran.stdout)


def answer_of(ran: Ran) -> dict:
    succeeded(ran)
    return json.loads(ran.stdout)


def text_of(messages: list[dict]) -> str:
    return "".join(message.get("text", "") for message in messages)


def streamed_with_text(ran: Ran) -> None:
    """README: each object is a message; the first carries inputTokens, the last finish (reason, usage,
    timings); the text is there."""
    messages = messages_of(ran)
    assert int(messages[0]["inputTokens"]) > 0 and text_of(messages).strip(), ran.stdout
    assert {"reason", "usage", "timings"} <= set(messages[-1]["finish"]), messages[-1]


def lists_services(ran: Ran) -> None:
    succeeded(ran)
    assert {"tokenspout.v1.GenerationService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= set(
        ran.stdout.split())


def calls_get_weather_for_paris(ran: Ran) -> None:
    """The call the README and the API guide show: get_weather, {"city":"Paris"}, a call_ id, TOOL_CALLS."""
    answer = answer_of(ran)
    assert answer["finish"]["reason"] == "FINISH_REASON_TOOL_CALLS", answer
    (call,) = answer["toolCalls"]
    assert call["name"] == "get_weather" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call["id"])
    assert json.loads(call["arguments"]) == {"city": "Paris"} and not answer.get("text")


def reasoning_then_json(ran: Ran) -> None:
    """The thinking in `reasoning`, only the constraint's JSON in `text`."""
    answer = answer_of(ran)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    assert answer.get("reasoning", "").strip() and "<think>" not in answer["text"], answer
    jsonschema.validate(json.loads(answer["text"]), schema)
    assert answer["finish"]["reason"] == "FINISH_REASON_CONSTRAINT_COMPLETE"


def prints_text(ran: Ran) -> None:
    succeeded(ran)
    assert ran.stdout.strip(), ran.output


def answers_the_result(ran: Ran) -> None:
    """The API guide's second turn: text, the turn ended by the model."""
    answer = answer_of(ran)
    assert answer.get("text", "").strip() and answer["finish"]["reason"] == "FINISH_REASON_EOS_TOKEN", answer


def python_round_trip(ran: Ran) -> None:
    """The arguments streamed as they formed (a JSON object naming Paris), then the text answer."""
    succeeded(ran)
    arguments, _, answer = ran.stdout.partition("}")
    assert json.loads(arguments + "}") == {"city": "Paris"} and answer.strip(), ran.stdout


def python_tour(ran: Ran) -> None:
    """clients.md's Python tour: the streamed text, its finish, a JSON object, then the refusal's reason and
    field."""
    succeeded(ran)
    streamed, finish, *rest = ran.stdout.split("\n[")[0], *ran.stdout.split("\n[")[1].splitlines()
    assert streamed.strip() and re.fullmatch(r"(max_tokens|eos_token): \d+ tokens\]", finish), ran.stdout
    assert rest[-1] == "INVALID_REQUEST [('sampling.temperature', 'must be in [0.0, 100.0]')]", ran.stdout
    assert rest[0].startswith("{"), ran.stdout


def cli_streams_text(ran: Ran) -> None:
    succeeded(ran)
    assert ran.stdout.strip() and re.fullmatch(r"\[(max_tokens|eos_token): \d+ tokens\]\n", ran.stderr), ran.output


def cli_city_json(ran: Ran) -> None:
    succeeded(ran)
    city = json.loads(json.loads(ran.stdout)["text"])
    assert set(city) == {"city", "country"} and all(isinstance(v, str) for v in city.values()), city


def cli_tokens(ran: Ran) -> None:
    tokens = answer_of(ran)
    pieces = b"".join(base64.b64decode(piece) for piece in tokens["pieces"])
    assert tokens["count"] == len(tokens["token_ids"]) == 2 and pieces == b"Hello world", tokens


def cli_info(ran: Ran) -> None:
    succeeded(ran)
    assert ran.stdout.startswith("SmolLM2-135M-Instruct-Q4_1 on llama.cpp (Q4_1), context "), ran.stdout


def describes(ran: Ran) -> None:
    succeeded(ran)
    assert "message GenerateStreamRequest {" in ran.stdout and "// " in ran.stdout, ran.stdout


def seeded_haiku(ran: Ran) -> None:
    messages = messages_of(ran)
    assert text_of(messages).strip() and "\n\n" not in text_of(messages), messages
    assert messages[-1]["finish"]["seed"] == "7"


def paris_with_logprobs(ran: Ran) -> None:
    answer = answer_of(ran)
    assert answer["text"].startswith(" Paris"), answer["text"]
    assert all("logprob" in token and len(token["topLogprobs"]) == 2 for token in answer["tokens"])


def four_samples(ran: Ran) -> None:
    samples = answer_of(ran)["samples"]
    assert len(samples) == 4 and all(sample.get("text", "").strip() for sample in samples), samples
    assert [sample["finish"]["seed"] for sample in samples] == ["7", "8", "9", "10"]


def truncated_with_prompt_logprobs(ran: Ran) -> None:
    answer = answer_of(ran)
    assert answer["truncatedInputTokens"] == 1 and answer["inputTokens"] == 2, answer
    assert [token["id"] for token in answer["promptTokens"]] == [3575, 282]


def cat_json(ran: Ran) -> None:
    cat = json.loads(text_of(messages_of(ran)))
    assert set(cat) == {"name", "age"} and 0 <= cat["age"] <= 30 and len(cat["name"]) <= 20, cat


def phone_number(ran: Ran) -> None:
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answer_of(ran)["text"])


def yes_or_no(ran: Ran) -> None:
    assert answer_of(ran)["text"] in {"yes", "no"}


def refused_constraint(ran: Ran) -> None:
    """INVALID_ARGUMENT, and grpcurl prints the details readably (reflection serves google.rpc's types)."""
    assert ran.returncode != 0 and "Code: InvalidArgument" in ran.stderr, ran.output
    assert '"reason":"INVALID_REQUEST"' in ran.stderr and '"field":"constraint.json_schema"' in ran.stderr, ran.stderr


def tokenized_with_offsets(ran: Ran) -> None:
    tokens = answer_of(ran)
    text = "héllo 🙂".encode()
    assert b"".join(base64.b64decode(piece) for piece in tokens["pieces"]) == text, tokens
    assert tokens["offsets"]["byteEnds"][-1] == len(text)


def two_results(ran: Ran) -> None:
    assert [result["count"] for result in answer_of(ran)["results"]] == [1, 1]


def model_info(ran: Ran) -> None:
    info = answer_of(ran)
    assert info["modelId"] == "SmolLM2-135M-Instruct-Q4_1" and info["quantization"] == "Q4_1", info


def status(ran: Ran) -> None:
    assert answer_of(ran)["maxBatchSize"] == 8


def serving(ran: Ran) -> None:
    assert answer_of(ran) == {"status": "SERVING"}


def nothing_to_cancel(ran: Ran) -> None:
    assert answer_of(ran) == {"notFound": ["my-request-1"]}


def refused(ran: Ran) -> None:
    """An error the page shows: a failing exit, and what it prints (the console lines)."""
    assert ran.returncode != 0, ran.output


@dataclasses.dataclass(frozen=True)
class Check:
    page: str
    finds: str
    """A piece of the example's code that no other example on its page has (or the whole of it)."""
    verify: Callable[[Ran], None] | None = None
    """What the page promises; None: it succeeds (and prints what its console block shows)."""
    runs: int = 1
    not_run: str = ""
    """Why the suite cannot run it."""


CHECKS = [
    Check("README.md", "make run", not_run="builds the environment the suite runs in, then serves"),
    Check("README.md", "make test", not_run="the suite itself"),
    Check("README.md", "export PATH="),
    Check("README.md", "127.0.0.1:50051 list", lists_services),
    Check("README.md", "Name three colours.", streamed_with_text),
    Check("README.md", '"tools"', calls_get_weather_for_paris),
    Check("README.md", "REASONING_MODE_ON", reasoning_then_json),
    Check("README.md", "from tokenspout import Client", prints_text, runs=RUNS),
    Check("README.md", "/models/any.gguf", not_run="a placeholder path; docs/getting-started.md serves a GGUF file here"),
    Check("README.md", "--engine exllamav2", not_run=GPU),
    Check("README.md", "--engine exllamav3", not_run=GPU),
    Check("docs/api.md", "TOOL_CHOICE_MODE_REQUIRED", calls_get_weather_for_paris),
    Check("docs/api.md", "TOOL_CHOICE_MODE_NONE", answers_the_result),
    Check("docs/api.md", "from tokenspout import Client, Message, Tool", python_round_trip),
    Check("docs/clients.md", "pip install ./clients/python", not_run="installs the package `make venv` installed"),
    Check("docs/clients.md", "from tokenspout import Client, InvalidRequestError", python_tour, runs=RUNS),
    Check("docs/clients.md", 'stream --chat "Why is the sky blue?"', cli_streams_text, runs=RUNS),
    Check("docs/clients.md", "> city.schema.json"),
    Check("docs/clients.md", "--json-schema @city.schema.json", cli_city_json, runs=RUNS),
    Check("docs/clients.md", "--json tokenize", cli_tokens),
    Check("docs/clients.md", "tokenspout-client info", cli_info),
    Check("docs/clients.md", 'import { TokenspoutClient } from "@tokenspout/client";', prints_text, runs=RUNS),
    Check("docs/clients.md", "assembleToolCalls", prints_text),
    Check("docs/clients.md", "127.0.0.1:50051 list", lists_services),
    Check("docs/clients.md", "describe tokenspout.v1.GenerateStreamRequest", describes),
    Check("docs/clients.md", '"topP": 0.9, "seed": 7', seeded_haiku),
    Check("docs/clients.md", "The capital of France is", paris_with_logprobs),
    Check("docs/clients.md", '"dry"', streamed_with_text, runs=RUNS),
    Check("docs/clients.md", '"n": 4', four_samples),
    Check("docs/clients.md", '"truncateInputTokens": 2', truncated_with_prompt_logprobs),
    Check("docs/clients.md", "Describe a cat as JSON.", cat_json),
    Check("docs/clients.md", '"regex"', phone_number, runs=RUNS),
    Check("docs/clients.md", '"choice"', yes_or_no, runs=RUNS),
    Check("docs/clients.md", "CompileConstraint", refused_constraint),
    Check("docs/clients.md", '"returnOffsets": true', tokenized_with_offsets),
    Check("docs/clients.md", '{"text": "héllo 🙂"}'),
    Check("docs/clients.md", '"texts": ["one", "two"]', two_results),
    Check("docs/clients.md", "GetModelInfo", model_info),
    Check("docs/clients.md", "GetServerStatus", status),
    Check("docs/clients.md", "Health/Check", serving),
    Check("docs/clients.md", "GenerationService/Cancel", nothing_to_cancel),
    Check("docs/clients.md", "http://gateway:8080",
          not_run="needs Envoy in front: tests/deploy/test_envoy_http.py posts JSON through a real Envoy"),
    Check("docs/configuration.md", "> bad.toml"),
    Check("docs/configuration.md", "--config bad.toml", refused),
    Check("docs/deployment.md", "docker build", not_run=NO_DOCKER),
    Check("docs/deployment.md", "docker run", not_run=NO_DOCKER),
    Check("docs/deployment.md", "create namespace", not_run=NO_CLUSTER),
    Check("docs/deployment.md", "create secret", not_run=NO_CLUSTER),
    Check("docs/deployment.md", "apply -k deploy/kubernetes/overlays/cpu-gguf", not_run=NO_CLUSTER),
    Check("docs/deployment.md", "kustomize deploy/kubernetes/overlays/cpu-gguf", not_run=NO_CLUSTER),
    Check("docs/deployment.md", "envoy-gateway", not_run=NO_CLUSTER),
    Check("docs/deployment.md", "llm-d-precise-prefix", not_run=NO_CLUSTER),
    Check("docs/getting-started.md", "make venv tools model", not_run="builds the environment the suite runs in"),
    Check("docs/getting-started.md", "export PATH="),
    Check("docs/getting-started.md", "tokenspout fetch-model"),
    Check("docs/getting-started.md", "tokenspout serve"),
    Check("docs/getting-started.md", 'stream --chat "Why is the sky blue?" --temperature 0'),
    Check("docs/getting-started.md", "127.0.0.1:50051 list"),
    Check("docs/getting-started.md", "~/models/my-model.gguf"),
    Check("docs/getting-started.md", "tokenspout-client info"),
    Check("docs/getting-started.md", "pip install torch", not_run=GPU),
    Check("docs/getting-started.md", "pip install '.[exllamav2]'", not_run=GPU),
    Check("docs/getting-started.md", "import exllamav2", not_run=GPU),
    Check("docs/getting-started.md", "--engine exllamav2", not_run=GPU),
    Check("docs/getting-started.md", "pip install '.[exllamav3]'", not_run=GPU),
    Check("docs/getting-started.md", "import exllamav3", not_run=GPU),
    Check("docs/getting-started.md", "--engine exllamav3", not_run=GPU),
    Check("docs/getting-started.md", "openssl rand"),
    Check("docs/getting-started.md", "sha256sum"),
    Check("docs/getting-started.md", "--api-keys-file api-keys"),
    Check("docs/getting-started.md", "GetModelInfo", refused),
    Check("docs/getting-started.md", 'Bearer $key'),
    Check("docs/getting-started.md", "TOKENSPOUT_API_KEY=$key"),
    Check("docs/getting-started.md", "openssl req"),
    Check("docs/getting-started.md", "--tls-cert server.crt"),
    Check("docs/getting-started.md", "-cacert server.crt"),
    Check("docs/getting-started.md", "--ca server.crt"),
    Check("docs/getting-started.md", "--prometheus-port 9090"),
    Check("docs/getting-started.md", "curl -s"),
    Check("docs/operations.md", "GetServerStatus", status),
    Check("docs/operations.md", "Health/Check", serving),
]


ALL = {str(page.relative_to(ROOT)): examples(page) for page in PAGES}


def check_for(example: Example) -> Check:
    """The check whose `finds` is the example's whole code, else the one found in it (a check that is some
    example's whole code finds that one only); exactly one."""
    same_page = [check for check in CHECKS if check.page == example.page]
    whole = {e.code for e in ALL.get(example.page, [])}
    exact = [check for check in same_page if check.finds == example.code]
    found = exact or [check for check in same_page if check.finds in example.code and check.finds not in whole]
    assert len(found) == 1, f"{example}: {len(found)} checks find it ({[c.finds for c in found]})"
    return found[0]


def test_every_example_has_one_check_and_every_check_its_example():
    for found in ALL.values():
        for example in found:
            check_for(example)
    used = {check_for(example).finds + check_for(example).page for found in ALL.values() for example in found}
    assert [check for check in CHECKS if check.finds + check.page not in used] == []


def test_the_examples_are_found_as_a_reader_sees_them():
    """The extraction itself: continuations joined, comments kept with their commands, console output."""
    clients = {example.line: example for example in ALL["docs/clients.md"]}
    dry = next(e for e in clients.values() if '"dry"' in e.code)
    assert dry.comment == "Less repetition with DRY" and dry.code.count("\n") == 2
    assert dry.code.endswith("tokenspout.v1.GenerationService/GenerateStream")
    (listing,) = [e for e in ALL["docs/getting-started.md"] if e.code == "grpcurl -plaintext 127.0.0.1:50051 list"]
    assert listing.kind == "console" and listing.prints[-1] == "tokenspout.v1.GenerationService"
    assert shown_in(("a…c", "x"), "abc\nzzz\nx\n") == "" and shown_in(("x", "a…c"), "abc\nx\n") != ""


@pytest.mark.parametrize("page", [name for name, found in ALL.items() if any(not check_for(e).not_run for e in found)])
def test_the_pages_examples_give_what_the_page_says(page, module_server, model_path, tmp_path):
    """On a server of the pages' own: each answer follows from the pages' examples, run in order as a reader runs
    them, whatever other tests left in a shared server's cache."""
    placeholders = {"~/models/my-model.gguf": str(tmp_path / "my-model.gguf")}
    (tmp_path / "my-model.gguf").symlink_to(model_path)  # a GGUF of the reader's own, by another name
    session = PageSession(tmp_path, module_server.address, placeholders, free_port())
    typescript = [example for example in ALL[page] if example.kind == "ts"]
    compiled = dict(zip(typescript, compile_typescript([session.localize(e.code) for e in typescript], tmp_path / "ts")
                        if typescript else []))
    ran = 0
    try:
        for example in ALL[page]:
            check = check_for(example)
            if check.not_run:
                continue
            if example in compiled:
                def run(example: Example = example) -> Ran:
                    return session.shell(f"node {compiled[example]}", keep_state=False)
            elif check.runs > 1:
                def run(example: Example = example) -> Ran:
                    return session.run(example, keep_state=False)
            else:
                def run(example: Example = example) -> Ran:
                    return session.run(example)
            with concurrent.futures.ThreadPoolExecutor(check.runs) as pool:  # side by side: batched
                results = list(pool.map(lambda _: run(), range(check.runs)))
            for result in results:
                problem = shown_in(example.prints, result.output)
                assert not problem, f"{example}: {problem}"
                try:
                    (check.verify or succeeded)(result)
                except AssertionError as error:
                    raise AssertionError(f"{example} does not give what the page says: {error}") from error
            ran += check.runs
    finally:
        session.stop()
    REPORT.append(f"docs examples: {page}: {ran} runs")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


NOT_WRITTEN_YET: dict[str, str] = {}
"""Links to sections still to be written, each with what it waits for; one that comes to exist fails the test
below until it leaves this list."""


def test_the_pages_links_lead_somewhere():
    """Every relative link of README.md and docs/ names a file that exists, and a heading in it where it
    names one (a page renamed or a heading reworded leaves no reader at a dead link)."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                prose = re.sub(r"^ *```.*?^ *```$", "", linked.read_text(), flags=re.MULTILINE | re.DOTALL)
                headings = {slug(h) for h in re.findall(r"^#+ (.+)$", prose, re.MULTILINE)}
                waits = (target if path else page.name + target) in NOT_WRITTEN_YET  # a link within its page too
                if (anchor not in headings) != waits:
                    broken.append(f"{page.name}: {target} ({'written now' if waits else 'no such heading'})")
    assert broken == []
