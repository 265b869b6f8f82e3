"""The `dyngen serve` front end (the grpc.aio process) never imports torch or the grammar engine.

Only the spawned engine process needs them: torch maps libtorch into the front end (measured:
about 330 MiB resident at SERVING with it, about 135 MiB without). Each check runs in a fresh
interpreter, since this test process has imported torch long before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.model.loader import WeightDtype
from engine.model.tokenizer import ChatMessage, HFTokenizer
from service.config import WEIGHT_DTYPES
from tests.tiny_service_model import write_servable_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ONLY = ("torch", "llguidance")

# What `dyngen serve` runs in its own process before the engine is ready: the command line
# (every subcommand's flags are built) and the server's modules.
SERVE_IMPORTS = """
import json, sys
from service.cli import build_parser
build_parser("serve").parse_args(["serve", "--port", "0"])
import service.config, service.frontend.server, service.frontend.servicer, service.frontend.engine_client, service.frontend.prompts
import service.frontend.limits, service.frontend.auth, service.frontend.metrics, service.ipc, service.frontend.event_buffer
import service.engine.process  # the engine's entry (imported in the spawned child); it imports torch in run()
print(json.dumps({
    "engine_only": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "llguidance", "transformers"}),
    "client": sorted(m for m in sys.modules if m.startswith("dyngen_client")),
}))
"""
# What the server may use of the client package: the contract (the generated stubs, the error
# reasons and their trailer, the affinity header and rule), none of the client's conveniences.
CONTRACT = ("dyngen_client.proto", "dyngen_client.errors", "dyngen_client.affinity")

# What the front end does once the engine is ready: load the tokenizer the engine saved, tokenize.
TOKENIZE = """
import json, sys
from pathlib import Path
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.frontend.prompts import PromptTokenizer
prompts = PromptTokenizer.load(Path(sys.argv[1]))
text = pb.TokenizeRequest(text=sys.argv[2])
chat = pb.TokenizeRequest()
message = chat.chat.messages.add(role="user", content=sys.argv[2])
ids = [prompts.token_ids(text), prompts.token_ids(chat)]
prompts.close()
print(json.dumps({"ids": ids, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def run_fresh(code: str, *args: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_serve_front_end_imports_no_torch() -> None:
    loaded = run_fresh(SERVE_IMPORTS)
    assert isinstance(loaded, dict)
    # transformers too: the front end imports it only when the engine's tokenizer arrives.
    assert loaded["engine_only"] == [], f"the front end imported {loaded['engine_only']}"


def test_the_server_depends_on_the_contract_not_the_client() -> None:
    loaded = run_fresh(SERVE_IMPORTS)
    assert isinstance(loaded, dict)
    beyond = [m for m in loaded["client"] if m != "dyngen_client" and not m.startswith(CONTRACT)]
    assert beyond == [], f"the server imported the client's {beyond}"
    assert "dyngen_client.proto.dyngen.v1.generator_pb2" in loaded["client"]


def test_front_end_tokenizer_loads_without_torch(tmp_path: Path) -> None:
    engine_tokenizer = HFTokenizer(write_servable_tiny_gguf(tmp_path / "tiny.gguf"))
    saved = tmp_path / "tokenizer"
    engine_tokenizer.save(saved)  # as the engine does before it reports ready
    prompt = "Hello, world! Ünïcode and  spaces."
    result = run_fresh(TOKENIZE, str(saved), prompt)
    assert isinstance(result, dict)
    assert not set(ENGINE_ONLY) & set(result["modules"]), result["modules"]
    assert result["ids"] == [
        engine_tokenizer.encode(prompt),
        engine_tokenizer.encode_chat([ChatMessage("user", prompt)]),
    ]


def test_weight_dtype_flag_values_match_the_engine() -> None:
    assert list(WEIGHT_DTYPES) == [d.value for d in WeightDtype]
