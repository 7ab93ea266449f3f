"""A real `deltaflash serve` process on 127.0.0.1 (any free port) for the server tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deltaflash.models.loader import load_model
from tests.checkpoints import build_hf_model, make_tokenizer, save_checkpoint
from tests.spec_pairs import save_drafter

READY = re.compile(r"on (http://127\.0\.0\.1:\d+) ")
# renders every message field deltaflash passes to the template (role, content, name, tool_call_id, tool_calls)
# and the tools; tools and calls as Qwen3.5's template does: a <tools> block of JSON, calls in the xml style
# (<tool_call><function=...>, whose arguments the server hands over as an object), results in <tool_response>
CHAT_TEMPLATE = ("{% if tools %}<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
                 "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
                 "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>"
                 "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}"
                 "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
                 "{% for k, v in c.function.arguments | items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
                 "{% endfor %}</function>\n</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>"
                 "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def tiny_pair(folder: Path, drafter: bool = True) -> tuple[Path, Path | None]:
    """The tiny dense target (vocab 320) with a tokenizer + chat template, and a DFlash drafter."""
    target = save_checkpoint(build_hf_model("dense_gqa", vocab_size=320), folder / "tiny")
    make_tokenizer(target, vocab_size=300)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    if not drafter:
        return target, None
    cfg = load_model(target, device="cpu", progress=False).cfg
    return target, save_drafter(folder / "tiny-draft", cfg)


def child_env() -> dict:
    # one intra-op thread: on a small shared CPU more threads spin against each other (~50x slower)
    return os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class ServerProcess:
    def __init__(self, model: Path, log: Path, *flags: str, draft: Path | None = None):
        cmd = [sys.executable, "-m", "deltaflash", "serve", "--model", str(model), "--device", "cpu",
               "--host", "127.0.0.1", "--port", "0", *flags]
        if draft is not None:
            cmd += ["--draft", str(draft)]
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=child_env())
        self.url = self._wait_ready(timeout_s=180)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = READY.search(self.log.read_text())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log.read_text()}")

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout_s: float = 20) -> dict:
        """Poll /health until no slot is live and nothing is queued."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if h["active_slots"] == 0 and h["queued"] == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s} s: {h}")
            time.sleep(0.05)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


def sse_payloads(lines) -> list:
    """`data:` payloads of an SSE body (decoded JSON, or the string '[DONE]')."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
