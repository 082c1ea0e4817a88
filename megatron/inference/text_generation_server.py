"""MegatronServer: HTTP front of the generation scheduler (stdlib ``ThreadingHTTPServer``).

``PUT /api`` (Megatron's format; POST accepted too), ``POST /completions`` and ``/v1/completions``
(OpenAI's). Each request runs in its own thread: it validates, tokenizes, submits its prompts to the
scheduler and waits; the scheduler (main thread) batches everyone's prompts into the same decode steps.
"""
import datetime
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron.inference.endpoints import (
    BadRequest,
    api_response,
    completions_response,
    parse_api_request,
    parse_completions_request,
)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: bursts of clients must not see dropped SYNs (1 s retries)


class _Handler(BaseHTTPRequestHandler):
    server_version = "MegatronServer/1.0"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # one line per request, on our terms (see _log)
        pass

    def _send(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None

    def _handle(self, path: str) -> None:
        app = self.server.app
        try:
            body = self._body()
            image_token = None if app.image_config is None else app.image_config.image_token_index
            if path == "/api":
                prompts, ids, params, images = parse_api_request(body, app.tokenizer, app.defaults, app.image_config)
                reqs = app.run(ids, params, images)
                out = api_response(prompts, reqs, app.tokenizer, params.return_log_probs, image_token)
            elif path in ("/completions", "/v1/completions"):
                texts, ids, params, echo, logprobs, images = parse_completions_request(
                    body, app.tokenizer, app.defaults, app.image_config)
                reqs = app.run(ids, params, images)
                out = completions_response(texts, reqs, app.tokenizer, echo, logprobs, app.model_name, image_token)
            else:
                self._send(404, {"message": f"no endpoint {path}; use PUT /api or POST /completions"})
                return
        except BadRequest as e:
            self._send(400, {"message": str(e)})
            return
        except RuntimeError as e:
            self._send(500, {"message": str(e)})
            return
        if not (isinstance(body, dict) and body.get("no_log")):
            print(f"{datetime.datetime.now()} {self.client_address[0]} {path}: {len(reqs)} prompt(s), "
                  f"{sum(len(r.generated_tokens) for r in reqs)} tokens generated", flush=True)
        self._send(200, out)

    def do_PUT(self):
        self._handle(self.path.rstrip("/"))

    def do_POST(self):
        self._handle(self.path.rstrip("/"))

    def do_GET(self):
        engine = self.server.app.scheduler.engine
        stats = {"status": "ok", "endpoints": ["PUT /api", "POST /completions"],
                 "active": sum(r is not None for r in engine.slots), "waiting": len(engine.waiting),
                 "peak_active": engine.peak_active}
        if engine.prefix_cache is not None:  # prompt tokens taken from the prefix cache vs prefilled so far
            stats.update(prompt_tokens_reused=engine.prefix_cache.reused_tokens,
                         prompt_tokens_computed=engine.prefix_cache.computed_tokens)
        self._send(200, stats)


class MegatronServer:
    """``scheduler``: a GenerationScheduler (run by the caller's thread); ``defaults``: the server's
    temperature / top_k / top_p for requests that set none of them; ``image_config``: how a
    vision-language model's request images become tiles (None: a text model)."""

    def __init__(self, scheduler, tokenizer, defaults: dict, model_name: str = "megatron", image_config=None):
        self.scheduler, self.tokenizer, self.defaults, self.model_name = scheduler, tokenizer, defaults, model_name
        self.image_config = image_config
        self.httpd = None

    def run(self, ids, params, images=None):
        """Submit every prompt (all validated before any is queued), wait, return the finished requests.
        ``images``: each prompt's PromptImages or None."""
        images = images or [None] * len(ids)
        for p, im in zip(ids, images):
            try:
                self.scheduler.engine.prepare_prompt(p, params, *((im.tiles, im.num_image_tiles) if im else ()))
            except ValueError as e:
                raise BadRequest(str(e)) from None
        tickets = [self.scheduler.submit(p, params, im) for p, im in zip(ids, images)]
        for t in tickets:
            t.done.wait()
        for t in tickets:
            if t.error or (t.request.finish_reason or "").startswith("error"):
                raise RuntimeError(t.error or t.request.finish_reason)
        return [t.request for t in tickets]

    def start(self, host: str, port: int) -> threading.Thread:
        """Serve HTTP on a background thread; the caller then runs the scheduler loop."""
        self.httpd = _Server((host, port), _Handler)
        self.httpd.app = self
        thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
        self.scheduler.stop()
