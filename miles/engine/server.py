"""The engine's HTTP server (aiohttp): the endpoints of docs/design.md §4 over one ModelRunner + StepScheduler.

Endpoints (see docs/engine.md):
- `POST /rollout/generate`            msgpack GenerateRequest -> msgpack GenerateResponse
- `POST /update_weights_from_tensor`  msgpack bucket message (weight_sync.py) -> JSON
- `GET  /server_info`                 JSON: weight_version, family, device, dtype, counters
- `GET  /weights_checksum`            JSON: sha256 per module over its parameters (`?per_tensor=1`, `?modules=a,b`,
                                      `?include_buffers=1`)
- `POST /release_memory_occupation`, `POST /resume_memory_occupation`, `GET /health`
- `POST /policy_gradient`, `POST /optimizer_state` (msgpack): the rollout's policy gradient, and the engine's own
  optimizer step on it (rollout_gradients.py, adapter_step.py)
- `POST /init_weights_update_group`, `POST /destroy_weights_update_group` (JSON): join / leave the trainer's
  weight broadcast group; `POST /update_weights_from_distributed` (msgpack bucket message: check and stage a
  broadcast bucket, or flush), `POST /receive_weights_broadcast` (JSON: receive the staged bucket and apply it);
  see weight_broadcast.py

Every endpoint requires `Authorization: Bearer <api key>` (401 otherwise; docs/security.md). Errors are one-line
JSON {"error": ...}: 400 for a malformed or unservable request (wrong type, value beyond a `--max-*` limit),
413 for a body over `--max-request-bytes`, 503 while the memory is released, 409 when releasing memory with
requests in flight, 500 for an internal failure. A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import replace
from typing import Any

import torch
from aiohttp import web

from miles.diffusion.mirrored_adamw import matches_host
from miles.engine.adapter_step import AdapterStepper
from miles.engine.model_runner import ModelRunner
from miles.engine.protocol import (
    CONTENT_TYPE,
    PolicyGradientAnswer,
    ProtocolError,
    RequestLimits,
    decode_optimizer_state,
    decode_policy_gradient_request,
    decode_request,
    encode_policy_gradient,
    encode_response,
)
from miles.engine.scheduler import StepScheduler
from miles.engine.server_args import ServerArgs
from miles.engine.weight_broadcast import (
    BroadcastMember,
    decode_group_name,
    decode_group_spec,
    decode_receive_request,
    device_identity,
)
from miles.engine.weight_sync import WeightReceiver, map_buffer, module_checksums
from miles.engine.weight_sync_wire import BroadcastRef, UpdateMessage, decode_buffer_ref, decode_update_message
from miles.utils.auth import bearer_auth_middleware, json_errors_middleware, resolve_api_key, warn_if_exposed
from miles.utils.http_guard import ConnectionLimits, GuardedSite, ServerGuard, quiet_bad_requests
from miles.utils.device_memory import current_device_memory
from miles.utils.errors import MilesUserError

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def request_limits(server_args: ServerArgs) -> RequestLimits:
    return RequestLimits(
        max_samples=server_args.max_samples_per_request,
        max_steps=server_args.max_num_steps,
        max_image_size=server_args.max_image_size,
        max_frames=server_args.max_num_frames,
        max_pixel_steps=server_args.max_request_pixel_steps,
        max_response_bytes=server_args.max_response_bytes,
    )


class EngineServer:
    """One engine: owns the runner, the scheduler, the weight receiver and the HTTP app (tests can start two)."""

    def __init__(self, server_args: ServerArgs, runner: ModelRunner | None = None, api_key: str | None = None):
        """`api_key`: what clients must send (default $MILES_API_KEY; an engine without a key refuses to start)."""
        self.server_args = server_args
        api_key = resolve_api_key(api_key, "the engine")  # before the model loads: fail in a second, not a minute
        self.limits = request_limits(server_args)
        began = time.perf_counter()
        self.runner = runner if runner is not None else ModelRunner(server_args)
        self.load_seconds = time.perf_counter() - began  # the pipeline's load, onto the device, patched
        self.scheduler = StepScheduler(self.runner, server_args.max_batch_size, server_args.batch_wait_ms,
                                       gradient_wave=server_args.rollout_gradient_tile)
        gradients = self.runner.rollout_gradients
        self.receiver = WeightReceiver({name: getattr(self.runner.pipe, name) for name in self.runner.module_names},
                                       on_lora_pair=None if gradients is None else gradients.set_factors)
        # the trainer's optimizer step taken here too (--rollout-gradient-engine-step), offered where this device
        # steps AdamW with the host's bits (checked once, here)
        self.adapter_stepper = None if gradients is None else AdapterStepper(gradients, self.receiver.merge_adapter)
        self.adamw_matches_host = gradients is not None and matches_host(self.runner.device)
        if gradients is not None:
            self.scheduler.after_last_gradient_wave.append(self.receiver.stage_lora_bases)
        self.memory_released = False
        self._admitted = 0  # generate requests being handled (reading, waiting for a batch, running)
        self.counters: dict[str, Any] = {
            "generate_requests": 0, "weight_updates": 0, "weight_buckets": 0, "bad_requests": 0
        }
        # the trainer's weight broadcast group this engine belongs to, and the bucket it staged for it
        self.weight_group: BroadcastMember | None = None
        self._staged_bucket: UpdateMessage | None = None
        self.device_identity = device_identity(self.runner.device)
        quiet_bad_requests(api_key)
        self.guard = ServerGuard(ConnectionLimits(read_timeout_s=server_args.connection_read_timeout,
                                                  max_connections=server_args.max_connections), "the engine")
        self.app = web.Application(
            client_max_size=server_args.max_request_bytes,
            middlewares=self.guard.middlewares(json_errors_middleware, bearer_auth_middleware(api_key)),
        )
        self.app.add_routes(
            [
                web.post("/rollout/generate", self.handle_generate),
                web.post("/update_weights_from_tensor", self.handle_update_weights),
                web.get("/server_info", self.handle_server_info),
                web.get("/weights_checksum", self.handle_checksum),
                web.post("/release_memory_occupation", self.handle_release),
                web.post("/resume_memory_occupation", self.handle_resume),
                web.get("/health", self.handle_health),
                web.post("/init_weights_update_group", self.handle_init_group),
                web.post("/destroy_weights_update_group", self.handle_destroy_group),
                web.post("/update_weights_from_distributed", self.handle_stage_broadcast),
                web.post("/receive_weights_broadcast", self.handle_receive_broadcast),
                web.post("/policy_gradient", self.handle_policy_gradient),
                web.post("/optimizer_state", self.handle_optimizer_state),
            ]
        )
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def _on_startup(self, app: web.Application) -> None:
        self.scheduler.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.scheduler.stop()
        if self.weight_group is not None:
            self.weight_group.close()
        self.runner.close()

    # ---- serving --------------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind (port 0 picks a free port) and serve; returns the URL."""
        warn_if_exposed(self.server_args.host, "the engine")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.server_args.host, self.server_args.port))
        # handler_cancellation: a client that disconnects cancels its handler, whose cancelled future makes the
        # scheduler drop the request at the next step
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await GuardedSite(self._runner, sock, self.guard).start()
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- handlers -------------------------------------------------------------------------------------------
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        if self._admitted >= self.server_args.max_queued_requests:
            self.counters["busy_refusals"] = self.counters.get("busy_refusals", 0) + 1
            return web.json_response(
                {"error": f"{self._admitted} generate requests admitted, the limit (--max-queued-requests); retry "
                          "shortly", "busy": True}, status=503, headers={"Retry-After": "1"})
        self._admitted += 1
        try:
            return await self._generate(request)
        finally:
            self._admitted -= 1

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.counters["generate_requests"] += 1
        crash_at = self.server_args.crash_after_requests
        if crash_at and self.counters["generate_requests"] >= crash_at:
            logger.error("crash drill: dying at generate request %d (--crash-after-requests)", crash_at)
            os._exit(1)  # abrupt on purpose: no answer, no cleanup, like a real crash mid-request
        if self.memory_released:
            return _error(503, "engine memory is released; POST /resume_memory_occupation first")
        body = await request.read()
        try:
            generate_request = decode_request(body, self.limits)
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        try:
            response = await self.scheduler.generate(generate_request)
        except (ProtocolError, MilesUserError, ValueError) as err:
            self.counters["bad_requests"] += 1
            return _error(400, f"{type(err).__name__}: {err}")
        except Exception as err:
            logger.exception("generate failed")
            return _error(500, f"{type(err).__name__}: {err}")
        payload = await asyncio.get_running_loop().run_in_executor(None, encode_response, response)
        self.counters["generate_answers"] = self.counters.get("generate_answers", 0) + 1
        if self.server_args.crash_after_answers and \
                self.counters["generate_answers"] == self.server_args.crash_after_answers:
            logger.error("crash drill: dying after generate answer %d (--crash-after-answers)",
                         self.server_args.crash_after_answers)
            asyncio.get_running_loop().call_later(0.5, os._exit, 1)  # the answer leaves first
        return web.Response(body=payload, content_type=CONTENT_TYPE)

    async def handle_update_weights(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            message = decode_update_message(body, torch.cuda.device_count())
            if isinstance(message.buffer, BroadcastRef):
                raise ProtocolError("a broadcast bucket goes to POST /update_weights_from_distributed")
            # shielded: a sender that disconnects must not leave copied weights under the old version number
            result = await asyncio.shield(self._apply_update(message))
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        except Exception as err:
            logger.exception("weight update failed")
            return _error(500, f"{type(err).__name__}: {err}")
        return web.json_response({"ok": True, "weight_version": self.runner.weight_version, **result})

    async def _apply_update(self, message) -> dict[str, Any]:
        def apply() -> dict[str, Any]:
            applied = self.receiver.apply(message)
            if message.flush:
                self.runner.weights_updated()  # CFG- or sequence-parallel followers take the finished update
            return applied

        applied, wait, seconds = await self.scheduler.run_exclusive_timed(apply)
        # the sender's report splits its push time into these (miles.engine.weight_sync.add_engine_seconds)
        result = {**applied, "wait_seconds": wait, "apply_seconds": seconds}
        self.counters["weight_buckets"] += 1
        if message.flush:
            self.runner.weight_version = message.weight_version
            self.counters["weight_updates"] += 1
            self.scheduler.wake()  # requests sent ahead for this version may start
        return result

    # ---- weight broadcast group (miles.engine.weight_broadcast) --------------------------------------------
    async def handle_init_group(self, request: web.Request) -> web.Response:
        """Check the fields, answer at once and join on a background thread (the join waits for every member)."""
        try:
            spec = decode_group_spec(await request.read())
            member = BroadcastMember(spec, self.runner.device)
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        previous, self.weight_group = self.weight_group, member
        self._staged_bucket = None
        if previous is not None:
            # on the worker thread: a receive of the old group may be running there
            await self.scheduler.run_exclusive(previous.close)
        member.start()
        logger.info("joining weight broadcast group %s as rank %d of %d (%s, master %s:%d)", spec.group_name,
                    spec.rank_offset, spec.world_size, spec.backend, spec.master_address, spec.master_port)
        return web.json_response({"ok": True, **member.describe()})

    async def handle_destroy_group(self, request: web.Request) -> web.Response:
        try:
            name = decode_group_name(await request.read())
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        member = self.weight_group
        if member is None or member.spec.group_name != name:
            return web.json_response({"ok": True, "left": False})  # not (or no longer) a member: nothing to do
        self.weight_group = None
        self._staged_bucket = None
        await asyncio.shield(self.scheduler.run_exclusive(member.close))
        return web.json_response({"ok": True, "left": True})

    async def handle_stage_broadcast(self, request: web.Request) -> web.Response:
        """Phase 1 of a broadcast bucket: check every entry (nothing is written) and stage it; or the flush."""
        body = await request.read()
        try:
            message = decode_update_message(body, torch.cuda.device_count())
            if message.flush:
                result = await asyncio.shield(self._apply_update(message))
                if self.weight_group is not None:
                    self.weight_group.release_scratch()
                return web.json_response({"ok": True, "weight_version": self.runner.weight_version, **result})
            if not isinstance(message.buffer, BroadcastRef):
                raise ProtocolError("POST /update_weights_from_distributed takes broadcast buckets; shared-memory "
                                    "and CUDA IPC buckets go to POST /update_weights_from_tensor")
            member = self.weight_group
            if member is None or member.spec.group_name != message.buffer.group_name:
                raise ProtocolError(f"not a member of weight broadcast group {message.buffer.group_name!r}")
            self._staged_bucket = None
            # the same checks as any bucket, on the worker thread (they read the LoRA halves pending there)
            steps = await self.scheduler.run_exclusive(self.receiver.plan, message)
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        self._staged_bucket = message
        return web.json_response({"ok": True, "staged": message.buffer.bucket, "entries": len(steps)})

    async def handle_receive_broadcast(self, request: web.Request) -> web.Response:
        """Phase 2: take part in the staged bucket's broadcast and copy it into the parameters."""
        try:
            receive = decode_receive_request(await request.read())
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        member = self.weight_group
        if member is None or member.spec.group_name != receive.group_name:
            self.counters["bad_requests"] += 1
            return _error(409, f"not a member of weight broadcast group {receive.group_name!r}")
        staged, self._staged_bucket = self._staged_bucket, None
        # shielded: the broadcast needs every member, whatever the HTTP client does meanwhile
        try:
            return await asyncio.shield(self._receive_and_apply(member, receive, staged))
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(409, str(err))
        except Exception as err:
            logger.exception("weight broadcast receive failed")
            return _error(500, f"{type(err).__name__}: {err}")

    async def _receive_and_apply(self, member: BroadcastMember, receive, staged: UpdateMessage | None) -> web.Response:
        def receive_and_apply() -> dict[str, Any]:
            # a member always takes part once asked (the trainer and the other engines are in the broadcast);
            # bytes that match no staged bucket are dropped
            received = member.receive(receive.size)
            ref = staged.buffer if staged is not None else None
            if not isinstance(ref, BroadcastRef) or ref.bucket != receive.bucket or ref.size != receive.size:
                raise ProtocolError(f"broadcast bucket {receive.bucket} ({receive.size} bytes) was not staged; its "
                                    "bytes were dropped")
            return self.receiver.apply(staged, received)

        result = await self.scheduler.run_exclusive(receive_and_apply)
        self.counters["weight_buckets"] += 1
        return web.json_response({"ok": True, "weight_version": self.runner.weight_version, **result})

    async def handle_policy_gradient(self, request: web.Request) -> web.Response:
        """Σ_b c_b·G_b over the rollout_gradient samples this engine holds (miles/engine/rollout_gradients.py): in
        the answer, or added into the asking trainer's buffer when the request names one (`into`); with `step`,
        the engine then takes the trainer's optimizer step on its adapter and moves to the request's weight version
        (miles/engine/adapter_step.py)."""
        gradients = self.runner.rollout_gradients
        if gradients is None:
            return _error(400, "this engine keeps no gradients: it was not started with --diffusion-rollout-gradient")
        try:
            asked = decode_policy_gradient_request(await request.read())
            ref = None if asked.into is None else decode_buffer_ref(asked.into, None, by_reference_only=True)
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))

        def add_into() -> PolicyGradientAnswer:
            with map_buffer(ref, writable=True) as flat:  # on CUDA: the add has finished when this exits
                layout, used, total = gradients.add_policy_gradient(asked.coefficients, flat)
            if asked.step is None:
                return PolicyGradientAnswer(used, layout=layout)
            stepped = self.adapter_stepper.step(total, asked.step)
            self.receiver.drop_staged_lora_bases()  # what the step did not merge (all of it when it did not step)
            if stepped.outcome != "no_state":
                self.runner.weights_updated()
            return PolicyGradientAnswer(used, layout=layout, step=stepped)

        def in_answer() -> PolicyGradientAnswer:
            gradient, used = gradients.policy_gradient(asked.coefficients)
            return PolicyGradientAnswer(used, gradient=gradient)

        async def answer_and_step() -> PolicyGradientAnswer:
            answer, wait, seconds = await self.scheduler.run_exclusive_timed(in_answer if ref is None else add_into)
            step = answer.step
            if step is not None and step.outcome != "no_state":  # the next version's weights: its rollout starts
                self.runner.weight_version = asked.weight_version
                self.counters["engine_steps"] = self.counters.get("engine_steps", 0) + 1
                self.scheduler.wake()
            return replace(answer, wait_seconds=wait, sum_seconds=seconds - (step.seconds if step else 0.0))

        try:
            # shielded: a trainer that disconnects must not leave stepped weights under the old version number
            answer = await asyncio.shield(answer_and_step())
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        payload = await asyncio.get_running_loop().run_in_executor(None, encode_policy_gradient, answer)
        return web.Response(body=payload, content_type=CONTENT_TYPE)

    async def handle_optimizer_state(self, request: web.Request) -> web.Response:
        """The trainer's AdamW moments, for the engine's own optimizer steps (miles/engine/adapter_step.py)."""
        if self.runner.rollout_gradients is None:
            return _error(400, "this engine keeps no gradients: it was not started with --diffusion-rollout-gradient")
        try:
            count, into = decode_optimizer_state(await request.read())
            ref = decode_buffer_ref(into, None, by_reference_only=True)

            def load() -> None:
                self.runner.rollout_gradients.check_pushed()
                with map_buffer(ref) as flat:
                    self.adapter_stepper.load_moments(count, flat.view(torch.float32))

            await asyncio.shield(self.scheduler.run_exclusive(load))
        except ProtocolError as err:
            self.counters["bad_requests"] += 1
            return _error(400, str(err))
        return web.json_response({"ok": True, "count": count})

    async def handle_server_info(self, request: web.Request) -> web.Response:
        runner = self.runner
        return web.json_response(
            {
                "weight_version": runner.weight_version,
                "family": runner.family.family,
                "model_path": self.server_args.model_path,
                "modules": list(runner.module_names),
                "device": str(runner.device),
                "dtype": str(runner.dtype).replace("torch.", ""),
                "generator_device": str(runner.generator_device),
                "max_batch_size": self.scheduler.max_batch_size,
                "patch_groups": runner.patch_groups,
                "parallel": runner.parallel_info(),
                "device_identity": self.device_identity,
                "adamw_matches_host": self.adamw_matches_host,
                "weights_update_group": self.weight_group.describe() if self.weight_group is not None else None,
                "compiled": bool(self.server_args.enable_torch_compile),
                "load_seconds": self.load_seconds,
                "memory_released": self.memory_released,
                "running_requests": self.scheduler.num_running,
                "cuda_memory": _device_memory(),  # what the colocation policy reads
                "counters": {**self.scheduler.counters.as_dict(), **self.counters},
            }
        )

    async def handle_checksum(self, request: web.Request) -> web.Response:
        names = request.query.get("modules")
        selected = names.split(",") if names else list(self.runner.module_names)
        unknown = [n for n in selected if n not in self.receiver.modules]
        if unknown:
            return _error(400, f"unknown modules {unknown}; this engine syncs {list(self.receiver.modules)}")
        per_tensor = request.query.get("per_tensor") in ("1", "true")
        include_buffers = request.query.get("include_buffers") in ("1", "true")
        modules = {n: self.receiver.modules[n] for n in selected}
        checksums = await self.scheduler.run_exclusive(module_checksums, modules, per_tensor, include_buffers)
        return web.json_response({"weight_version": self.runner.weight_version, "checksums": checksums})

    async def handle_release(self, request: web.Request) -> web.Response:
        if self.scheduler.num_running:
            return _error(409, f"{self.scheduler.num_running} request(s) in flight; release memory when idle")
        return await self._answer_memory_change(released=True)

    async def handle_resume(self, request: web.Request) -> web.Response:
        return await self._answer_memory_change(released=False)

    async def _answer_memory_change(self, released: bool) -> web.Response:
        try:
            # shielded: a client that disconnects must not leave the flag disagreeing with the memory
            await asyncio.shield(self._set_memory_released(released))
        except Exception as err:  # noqa: BLE001 - answered with its text (out of memory, most often), logged whole
            what = "releasing" if released else "resuming"
            logger.exception("%s the engine's memory failed", what)
            return _error(500, f"{what} the engine's memory failed: {type(err).__name__}: {err}")
        return web.json_response({"ok": True, "memory_released": released, **_cuda_memory()})

    async def _set_memory_released(self, released: bool) -> None:
        if released != self.memory_released:
            if released:
                await self.scheduler.run_exclusive(self.receiver.drop_staged_lora_bases)
            await self.scheduler.run_exclusive(self.runner.release_memory if released else self.runner.resume_memory)
            self.memory_released = released

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "weight_version": self.runner.weight_version})


def _device_memory() -> dict[str, int] | None:
    memory = current_device_memory()
    return memory.as_dict() if memory is not None else None


def _cuda_memory() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    return {"cuda_memory_allocated": torch.cuda.memory_allocated(), "cuda_memory_reserved": torch.cuda.memory_reserved()}


async def serve_forever(server_args: ServerArgs, on_ready=None, api_key: str | None = None) -> None:
    """Load the model, bind, call `on_ready(url)`, and serve until cancelled."""
    server = EngineServer(server_args, api_key=api_key)
    url = await server.start()
    if on_ready is not None:
        on_ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
