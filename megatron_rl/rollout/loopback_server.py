"""A small HTTP server that speaks SGLang's RL endpoints, backed by an `InProcessEngine`.

For tests, benchmarks and the embedded demo; not a serving system. It implements the subset of
SGLang 0.5's HTTP API (field names from ``sglang/srt/managers/io_struct.py``) that
`SGLangEngine` uses: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``return_routed_experts``; answer ``output_ids`` and ``meta_info``),
``/health``, ``/get_model_info``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, ``/update_weights_from_tensor``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``.

Differences from SGLang, deliberately: ``update_weights_from_tensor`` takes tensors serialised
with ``torch.save`` and base64 (there are no CUDA IPC handles on CPU); one extra endpoint,
``/weights_checksum`` (SGLang has none), serves the checksum mode. ``before_request`` lets tests
inject faults: return "drop" (close without answering), "503", "stall" (sleep ``stall_s``), or
"die" (stop the server, dropping the request).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megatron_rl.rollout.inprocess import InProcessEngine
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.weight_group import join_weight_group, receive_bucket

logger = logging.getLogger(__name__)


class LoopbackServer:
    """Serve ``engine`` on ``host:port`` (port 0: a free port) from a background thread."""

    def __init__(self, engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.before_request: Callable[[str, object], str | None] | None = None
        self.stall_s = 30.0
        self.requests: list[str] = []  # paths served, in order (tests inspect it)
        self.weight_groups: dict[str, object] = {}
        self._resume = threading.Event()
        self._resume.set()
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> LoopbackServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ endpoints
    def handle(self, path: str, payload: dict) -> tuple[int, object]:
        routes = {
            "/health": lambda p: (200, None),
            "/get_model_info": lambda p: (200, self._model_info()),
            "/flush_cache": lambda p: (200, self._flush()),
            "/pause_generation": lambda p: (200, self._resume.clear()),
            "/continue_generation": lambda p: (200, self._resume.set()),
            "/generate": self._generate,
            "/update_weights_from_disk": self._from_disk,
            "/update_weights_from_tensor": self._from_tensor,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weight_version": self._update_version,
            "/weights_checksum": lambda p: (200, self.engine.checksums(p["names"])),
        }
        if path not in routes:
            return 404, {"error": f"unknown endpoint {path}"}
        return routes[path](payload)

    def _model_info(self) -> dict:
        return {
            "model_path": "loopback",
            "is_generation": True,
            "weight_version": str(self.engine.weight_version),
        }

    def _flush(self) -> None:
        self.engine.flush_cache()

    def _generate(self, payload: dict) -> tuple[int, object]:
        if not self._resume.wait(timeout=60):
            return 503, {"error": "generation paused for more than 60 s"}
        sampling = dict(payload.get("sampling_params") or {})
        if int(sampling.pop("n", 1)) != 1:
            return 400, {"error": "the loopback server supports n=1 per request"}
        params = SamplingParams(
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=int(sampling.get("top_k", -1)),
            max_new_tokens=int(sampling.get("max_new_tokens", 128)),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
        )
        ids = [int(t) for t in payload["input_ids"]]
        routes = bool(payload.get("return_routed_experts", False))
        sample = self.engine.generate_one(
            ids, params, sample_seed=sampling.get("sampling_seed"), return_routed_experts=routes
        )
        out = sample.response_ids_R.tolist()
        meta = {
            "id": payload.get("rid"),
            "finish_reason": {"type": sample.finish_reason},
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": str(sample.weight_version),
        }
        if payload.get("return_logprob"):
            lps = sample.logprobs_R.tolist()
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out, strict=True)]
            if payload.get("logprob_start_len", -1) == 0:
                scores = self.engine.score(ids).tolist()
                meta["input_token_logprobs"] = [[None, ids[0], None]] + [
                    [lp, t, None] for lp, t in zip(scores, ids[1:], strict=True)
                ]
        if routes:
            int32 = self.engine.codec.decode(sample.routes, dtype=torch.int32)
            meta["routed_experts"] = base64.b64encode(int32.numpy().tobytes()).decode()
        return 200, {"output_ids": out, "meta_info": meta}

    def _commit(self, payload: dict) -> None:
        version = payload.get("weight_version")
        if version is not None:
            self.engine.set_version(int(version))

    def _update_version(self, payload: dict) -> tuple[int, object]:
        self.engine.set_version(int(payload["new_version"]))
        return 200, {"success": True, "message": f"version {payload['new_version']}"}

    def _from_disk(self, payload: dict) -> tuple[int, object]:
        from megatron_rl.model.conversion.safetensors_io import CheckpointReader

        try:
            with CheckpointReader(payload["model_path"]) as reader:
                count = self.engine.load_weights_in_place(
                    (n, reader.get(n)) for n in reader.names()
                )
        except (OSError, ValueError) as err:
            return 200, {"success": False, "message": f"{type(err).__name__}: {err}"}
        self._commit(payload)
        return 200, {"success": True, "message": f"loaded {count} tensors"}

    def _from_tensor(self, payload: dict) -> tuple[int, object]:
        raw = base64.b64decode(payload["serialized_named_tensors"][0])
        named = torch.load(io.BytesIO(raw), weights_only=True)
        try:
            count = self.engine.load_weights_in_place(named)
        except ValueError as err:
            return 200, {"success": False, "message": str(err)}
        self._commit(payload)
        return 200, {"success": True, "message": f"loaded {count} tensors"}

    def _init_group(self, payload: dict) -> tuple[int, object]:
        group = join_weight_group(
            backend=payload.get("backend", "gloo"),
            master_address=payload["master_address"],
            master_port=int(payload["master_port"]),
            rank=int(payload["rank_offset"]),
            world_size=int(payload["world_size"]),
        )
        self.weight_groups[payload["group_name"]] = group
        return 200, {"success": True, "message": "joined"}

    def _from_distributed(self, payload: dict) -> tuple[int, object]:
        group = self.weight_groups.get(payload["group_name"])
        if group is None:
            return 200, {"success": False, "message": f"no group {payload['group_name']!r}"}
        tensors = receive_bucket(group, payload["names"], payload["dtypes"], payload["shapes"])
        try:
            count = self.engine.load_weights_in_place(tensors)
        except ValueError as err:
            return 200, {"success": False, "message": str(err)}
        self._commit(payload)
        return 200, {"success": True, "message": f"loaded {count} tensors"}

    def _destroy_group(self, payload: dict) -> tuple[int, object]:
        self.weight_groups.pop(payload.get("group_name", ""), None)
        return 200, {"success": True, "message": "destroyed"}


class _Handler(BaseHTTPRequestHandler):
    app: LoopbackServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug(fmt, *args)

    def do_GET(self) -> None:
        self._serve(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self._serve(json.loads(self.rfile.read(length) or b"null"))

    def _serve(self, payload: object) -> None:
        path = self.path.split("?")[0]
        app = self.app
        app.requests.append(path)
        fault = app.before_request(path, payload) if app.before_request else None
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault == "die":
            self.close_connection = True
            self.connection.shutdown(2)
            threading.Thread(target=app.stop, daemon=True).start()
            return
        if fault == "stall":
            time.sleep(app.stall_s)
        if fault == "503":
            status, body = 503, {"error": "injected 503"}
        else:
            try:
                status, body = app.handle(path, payload or {})
            except (KeyError, TypeError, ValueError) as err:
                status, body = 400, {"error": f"{type(err).__name__}: {err}"}
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    """``python -m megatron_rl.rollout.loopback_server --port P``: serve a random tiny model."""
    from megatron_rl.model import preset_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    engine = InProcessEngine.from_hf_config(preset_config(args.preset), seed=args.seed)
    server = LoopbackServer(engine, port=args.port)
    logger.info("loopback server on %s", server.url)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
