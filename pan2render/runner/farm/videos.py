"""OpenAI's Videos API on the farm (``/v1/videos``), backed by its durable queue: each video is a
one-job batch in ``ROOT/videos/<user>/<video id>/``, so a video created survives a farm killed and
started again, and is rendered once.

    POST   /v1/videos                      create (JSON, or multipart with an ``input_reference`` image)
    GET    /v1/videos                      the user's videos (?after, ?limit, ?order=asc|desc)
    GET    /v1/videos/{id}                 one video
    DELETE /v1/videos/{id}                 cancel it if it has not ended, and list it no more (?files=true:
                                           remove its folder too, once it has ended)
    GET    /v1/videos/{id}/content         ?variant=video (the mp4), thumbnail (its poster, PNG),
                                           spritesheet (a strip of its frames, PNG)

A request's parameters take OpenAI's names (``prompt``, ``model``, ``size`` "WIDTHxHEIGHT",
``seconds``), the names the open servers use for the rest (``num_frames``, ``fps``, ``seed``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``flow_shift``, ``width``,
``height``, ``lora``), or our own job fields and ``preset``; each is checked with the limits of a
batch's field, and a refusal names the parameter as the request spelled it. Every answer for a
video not ended carries ``openai-poll-after-ms``, which OpenAI's client waits before asking again.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

from pan2render.jobs.batch import load_batch
from pan2render.jobs.ledger import JobState, Ledger
from pan2render.jobs.overrides import Overrides
from pan2render.jobs.spec import BatchValidationError
from pan2render.long_video import video_fps, video_frames
from pan2render.runner.farm.http import ApiError, parse_json_object, route, user_of
from pan2render.runner.farm.queue import BatchState, FarmQueue, QueuedBatch
from pan2render.runner.protocol.artifacts import SAMPLING_STEP_DOC
from pan2render.runner.serve.session import BatchRequest
from pan2render.runner.views.posters import POSTER_DIR, poster
from pan2render.tiny_dit import TINY_MODEL

if TYPE_CHECKING:
    from pan2render.runner.farm.api import Reads
    from pan2render.runner.farm.intake import Roots
    from pan2render.runner.farm.service import Farm

POLL_AFTER_MS = 1000  # how long a client waits between two looks at a video not ended
LIST_DEFAULT, LIST_MAX = 20, 100
ID = re.compile(r"video_[0-9a-f]{24}")
SPRITE_TILES, SPRITE_SIDE = 8, 160
INPUT_NAMES = {"image/png": "input.png", "image/jpeg": "input.jpg", "image/webp": "input.webp"}
DEFAULT_PRESET = {TINY_MODEL: "tiny-preview"}  # else the preset of the model's size, pan2-720p

# The request's names for our job fields (OpenAI's and the open servers'); our own names pass as they are.
ALIASES = {"num_frames": "frames", "num_inference_steps": "steps", "guidance_scale": "guidance"}
JOB_PARAMS = ("negative_prompt", "seed", "steps", "guidance", "height", "width", "frames", "fps", "flow_shift",
              "sampler", "crf", "timesteps", "cache", "guidance_until", "precision", "loras", "gpus",
              "encode_preset", "encode_tune")
NUMBERS = {"seed": int, "steps": int, "height": int, "width": int, "frames": int, "crf": int, "gpus": int,
           "guidance": float, "fps": float, "flow_shift": float, "guidance_until": float}
ACCEPTED = ("prompt", "model", "size", "seconds", "preset", "lora", "input_reference", *ALIASES, *JOB_PARAMS)


class VideosApi:
    def __init__(self, farm: Farm, reads: Reads, roots: Roots):
        self.farm = farm
        self.reads = reads
        self.roots = roots

    # ------------------------------------------------------------------ create
    @route("POST", "/v1/videos")
    async def create(self, request: web.Request) -> web.Response:
        user = user_of(request)
        params, image = await _params(request)
        video_id = f"video_{secrets.token_hex(12)}"
        folder = self.farm.videos_root / user.name / video_id
        loop = asyncio.get_running_loop()
        req, summary = await loop.run_in_executor(None, self._batch, params, image, folder, video_id)
        from pan2render.runner.farm.api import apply

        try:
            await apply(self.farm, request, f"create {video_id}",
                        lambda: self.farm.actions.submit(req, owner=user.name, video_id=video_id, video=summary))
        except ApiError as e:
            if e.status != 503:  # refused: nothing of it stays (a 503'd request is still in line)
                shutil.rmtree(folder, ignore_errors=True)
            raise
        return await self._answer(video_id, user, status=200)

    def _batch(self, params: dict[str, Any], image: tuple[str, bytes] | None, folder: Path,
               video_id: str) -> tuple[BatchRequest, dict[str, Any]]:
        """The one-job batch a request asks for, validated as a batch file is (on an API thread)."""
        models = self.farm.config.model_paths()
        name = str(params.pop("model", None) or self.farm.config.default_model)
        if name not in models:
            raise ApiError(400, f"model {name!r} is not served here; allowed: {', '.join(sorted(models))} "
                                f"(`farm start --model NAME=PATH` serves more)", param="model", code="model_not_found")
        named = {k: k for k in params}  # our field -> the request's name for it, for messages
        job: dict[str, Any] = {"name": video_id, "prompt": _text(params.pop("prompt", None), "prompt")}
        for key, value in params.items():
            ours = ALIASES.get(key, key)
            named[ours] = key
            if ours in NUMBERS:
                job[ours] = _number(value, NUMBERS[ours], key)
            elif ours in JOB_PARAMS:
                job[ours] = value
        if "size" in params:
            job["width"], job["height"] = _size(params["size"])
            named.update(width="size", height="size")
        if "lora" in params:
            job["loras"] = [params["lora"]] if isinstance(params["lora"], str) else params["lora"]
            named["loras"] = "lora"
        preset = str(params.get("preset") or DEFAULT_PRESET.get(name, "pan2-720p"))
        if "seconds" in params and "frames" not in job:
            job["frames"] = _frames(params["seconds"], job.get("fps"), preset)
            named["frames"] = "seconds"
        folder.mkdir(parents=True)
        if image is not None:
            path = folder / image[0]
            path.write_bytes(image[1])
            job["image"] = str(path)
        doc = {"model": models[name], "preset": preset, "jobs": [job]}
        roots = (*self.roots.inputs, folder.resolve(), *(Path(p).resolve() for p in models.values() if p != TINY_MODEL))
        try:
            batch = load_batch(folder / "request.yaml", text=yaml.safe_dump(doc, sort_keys=False), roots=roots,
                               flags_dir=folder, overrides=Overrides())
        except BatchValidationError as e:
            shutil.rmtree(folder, ignore_errors=True)  # (made here for its image: nothing of it stays)
            params_named = [named.get(_field_of(p.field), p.field) for p in e.problems]
            raise ApiError(400, "; ".join(f"{n}: {p.message}" for n, p in zip(params_named, e.problems)),
                           param=params_named[0], code="invalid_value") from None
        summary = {"model": name, "prompt": job["prompt"], "preset": preset}
        return BatchRequest(out_dir=folder, batch=batch, overrides=Overrides()), summary

    # ------------------------------------------------------------------ read
    @route("GET", "/v1/videos")
    async def list(self, request: web.Request) -> web.Response:
        user = user_of(request)
        q = request.query
        limit = _query_int(q.get("limit"), "limit", LIST_DEFAULT, 1, LIST_MAX)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order {order[:20]!r}: asc or desc", param="order")
        after = q.get("after")
        if after is not None and not ID.fullmatch(after):
            raise ApiError(400, f"after {after[:40]!r}: a video id", param="after")
        rows, more = await self.reads.run(FarmQueue.videos, owner=None if user.admin else user.name, after=after,
                                          limit=limit, newest_first=order == "desc")
        data = [await self._video(r) for r in rows]
        return web.json_response({"object": "list", "data": data, "has_more": more,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    @route("GET", "/v1/videos/{id}")
    async def retrieve(self, request: web.Request) -> web.Response:
        return await self._answer(request.match_info["id"], user_of(request))

    async def _row(self, video_id: str, user: Any) -> QueuedBatch:
        row = await self.reads.run(FarmQueue.by_video, video_id) if ID.fullmatch(video_id) else None
        if row is None or row.hidden or (row.owner != user.name and not user.admin):
            raise ApiError(404, f"no video {video_id[:40]!r} here", param="video_id", code="video_not_found")
        return row

    async def _answer(self, video_id: str, user: Any, *, status: int = 200) -> web.Response:
        video = await self._video(await self._row(video_id, user))
        headers = {} if video["status"] in ("completed", "failed") else {"openai-poll-after-ms": str(POLL_AFTER_MS)}
        return web.json_response(video, status=status, headers=headers)

    async def _video(self, row: QueuedBatch) -> dict[str, Any]:
        running = {(r["batch"], r["job"]): r for r in self.farm.snapshot().get("running", [])}
        return await asyncio.get_running_loop().run_in_executor(None, video_object, row, running)

    # ------------------------------------------------------------------ delete, content
    @route("DELETE", "/v1/videos/{id}")
    async def delete(self, request: web.Request) -> web.Response:
        user = user_of(request)
        row = await self._row(request.match_info["id"], user)
        files = request.query.get("files") in ("1", "true")
        from pan2render.runner.farm.api import apply

        def run() -> dict[str, Any]:
            cancelled = False
            now = self.farm.queue.get(row.id)
            if not now.state.ended and now.state is not BatchState.CANCELLING:
                self.farm.actions.cancel(row.id, user=user)
                cancelled = True
            hidden = self.farm.actions.hide(row.id, user=user, remove_files=files)
            return {"cancelled": cancelled, "files_removed": hidden["files_removed"]}

        done = await apply(self.farm, request, f"delete {row.video_id}", run)
        return web.json_response({"id": row.video_id, "object": "video.deleted", "deleted": True, **done})

    @route("GET", "/v1/videos/{id}/content")
    async def content(self, request: web.Request) -> web.StreamResponse:
        row = await self._row(request.match_info["id"], user_of(request))
        variant = request.query.get("variant", "video")
        if variant not in ("video", "thumbnail", "spritesheet"):
            raise ApiError(400, f"variant {variant[:20]!r}: video, thumbnail or spritesheet", param="variant")
        video = await asyncio.get_running_loop().run_in_executor(None, _finished_video, row)
        if variant == "video":
            return web.FileResponse(video, headers={"Content-Type": "video/mp4"})
        png = await asyncio.get_running_loop().run_in_executor(None, _picture, row, video, variant)
        return web.Response(body=png, content_type="image/png")


# ---------------------------------------------------------------------- the Video object
def video_object(row: QueuedBatch, running: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's ``Video`` for a video's batch, from the queue row and its ledger (read-only)."""
    job, stages_done, step = _job_of(row)
    spec = job.spec if job is not None else None
    status, error = _status(row, job)
    live = running.get((row.id, job.id)) if job is not None else None
    size = f"{spec.width}x{spec.height}" if spec else "0x0"
    seconds = f"{video_frames(spec) / video_fps(spec):g}" if spec else "0"
    out: dict[str, Any] = {
        "id": row.video_id, "object": "video", "created_at": int(row.submitted_at),
        "completed_at": int(row.updated_at) if status in ("completed", "failed") else None,
        "model": (row.video or {}).get("model", "tiny"), "progress": _progress(status, stages_done, live, step),
        "prompt": spec.prompt if spec else (row.video or {}).get("prompt"), "seconds": seconds, "size": size,
        "status": status, "error": error, "expires_at": None, "remixed_from_video_id": None,
        # ours
        "seed": spec.seed if spec else None, "job_id": job.id if job else None, "batch_id": row.id,
        "params": {k: v for k, v in spec.to_dict().items() if k != "prompt"} if spec else None,
    }
    return out


def _job_of(row: QueuedBatch) -> tuple[Any, int, tuple[int, int] | None]:
    """The video's job record, how many of its stages are done, and its recorded step (k, N)."""
    try:
        ledger = Ledger.open_readonly(Path(row.out_dir))
    except Exception:  # not recorded yet, or its folder is gone
        return None, 0, None
    try:
        jobs = ledger.jobs(row.job_ids)
        if not jobs:
            return None, 0, None
        job = jobs[0]
        done = sum(r.state.value == "done" for r in ledger.stages(job.id).values())
        doc = ledger.document(job.id, SAMPLING_STEP_DOC)
        step = None
        if doc:
            rec = json.loads(doc)
            step = (int(rec["step"]), int(rec["steps"]))
        return job, done, step
    finally:
        ledger.close()


def _status(row: QueuedBatch, job: Any) -> tuple[str, dict[str, str] | None]:
    if job is not None and job.state is JobState.DONE:
        return "completed", None
    if job is not None and job.state is JobState.FAILED:
        return "failed", {"code": _failure_code(job.error), "message": job.error or "failed"}
    if (job is not None and job.state is JobState.CANCELLED) or row.state in (BatchState.CANCELLED,
                                                                               BatchState.CANCELLING):
        return "failed", {"code": "cancelled", "message": "the video was cancelled"}
    if row.state is BatchState.STOPPED:
        return "failed", {"code": "storage", "message": row.reason or "its folder refused a write"}
    if row.state.ended:
        return "failed", {"code": "unknown", "message": row.reason or row.state.value}
    if job is not None and job.state is JobState.RUNNING:
        return "in_progress", None
    return "queued", None


def _failure_code(error: str | None) -> str:
    """The failure class a failed job's error ends with ("... [input: not retryable ...]")."""
    found = re.search(r"\[([a-z-]+): [^\]]*\]\s*$", error or "")
    return found.group(1) if found else "unknown"


# Where each stage's work starts and ends on the way to 100 (sampling is nearly all of it).
_SPANS = {"loading model": (0, 2), "conditioning": (2, 5), "sampling": (5, 90), "decode": (90, 95),
          "encode": (95, 99)}


def _progress(status: str, stages_done: int, live: dict[str, Any] | None, step: tuple[int, int] | None) -> int:
    if status == "completed":
        return 100
    if status == "queued" or live is None:
        return min(99, [0, 5, 90, 95, 99][min(stages_done, 4)]) if status != "failed" else 0
    low, high = next((span for name, span in _SPANS.items() if live["stage"].startswith(name)), (0, 99))
    k, n = (live["step"], live["total"]) if live.get("step") is not None else (step or (0, 1))
    return int(low + (high - low) * (k / n if n else 0)) if live["stage"].startswith("sampling") else low


# ---------------------------------------------------------------------- content
def _finished_video(row: QueuedBatch) -> Path:
    job, _, _ = _job_of(row)
    path = Path(row.out_dir) / job.id / "video.mp4" if job is not None else None
    if job is None or job.state is not JobState.DONE or path is None or not path.is_file() or path.is_symlink():
        raise ApiError(404, "the video has not completed: its content is not there yet", code="video_not_ready")
    return path


def _picture(row: QueuedBatch, video: Path, variant: str) -> bytes:
    from pan2render.media.video import contact_strip_png

    out = Path(row.out_dir)
    if variant == "thumbnail":
        rel = poster(out, video.parent.name, video, None, say=lambda text: None)
        if rel is None:
            raise ApiError(404, "no thumbnail could be made of this video", code="video_not_ready")
        return (out / rel).read_bytes()
    path = out / POSTER_DIR / f"{video.parent.name}.sprites.png"
    if not path.is_file():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(contact_strip_png(video, tiles=SPRITE_TILES, max_side=SPRITE_SIDE))
    return path.read_bytes()


# ---------------------------------------------------------------------- the request's parameters
async def _params(request: web.Request) -> tuple[dict[str, Any], tuple[str, bytes] | None]:
    """The parameters of a create, from JSON or a multipart form, and its input image (a file name
    by type, the bytes), if one came."""
    image = None
    if request.content_type.startswith("multipart/"):
        form = await request.post()
        params: dict[str, Any] = {}
        for key, value in form.items():
            if isinstance(value, web.FileField):
                if key != "input_reference":
                    raise ApiError(400, f"{key!r}: only input_reference may be a file", param=key)
                name = INPUT_NAMES.get(value.content_type or "")
                if name is None:
                    raise ApiError(400, f"input_reference is {value.content_type}; allowed: PNG, JPEG or WebP",
                                   param="input_reference")
                image = (name, value.file.read())
            else:
                params[key] = value
    else:
        params = parse_json_object(await request.read())
        if "input_reference" in params:
            raise ApiError(400, "input_reference: send the image as a file in a multipart request",
                           param="input_reference")
    unknown = sorted(set(params) - set(ACCEPTED))
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; accepted: {', '.join(ACCEPTED)}", param=unknown[0],
                       code="unknown_parameter")
    return params, image


def _field_of(dotted: str) -> str:
    """The job field a problem names ("jobs[0].frames" -> "frames"; "preset" stays)."""
    return dotted.rsplit(".", 1)[-1].split("[")[0]


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ApiError(400, f"{name} is required: a non-empty string", param=name)
    return value


def _number(value: Any, kind: type, name: str) -> Any:
    """A number from JSON (its type) or a form (its text); a bool is no number."""
    if isinstance(value, bool):
        raise ApiError(400, f"{name}: a number, not {value}", param=name)
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        raise ApiError(400, f"{name} {str(value)[:40]!r}: {'an integer' if kind is int else 'a number'}",
                       param=name) from None
    if kind is int and isinstance(number, float) and number.is_integer():
        number = int(number)
    if not isinstance(number, (int, float)) or (kind is int and not isinstance(number, int)):
        raise ApiError(400, f"{name} {str(value)[:40]!r}: {'an integer' if kind is int else 'a number'}", param=name)
    return number


def _size(value: Any) -> tuple[int, int]:
    found = re.fullmatch(r"(\d{1,5})x(\d{1,5})", str(value))
    if not found:
        raise ApiError(400, f"size {str(value)[:40]!r}: WIDTHxHEIGHT in pixels, each a multiple of 32 up to 4096, "
                            f"e.g. 1248x704", param="size", code="invalid_size")
    width, height = int(found.group(1)), int(found.group(2))
    if not (0 < width <= 4096 and 0 < height <= 4096 and width % 32 == 0 and height % 32 == 0):
        raise ApiError(400, f"size {value!r}: width and height must each be a positive multiple of 32 up to 4096 "
                            f"(e.g. 1248x704)", param="size", code="invalid_size")
    return width, height


def _frames(seconds: Any, fps: Any, preset: str) -> int:
    """The frame count of ``seconds`` at the fps asked (else the preset's): 4k+1 frames, the nearest."""
    from pan2render.jobs.presets import list_presets

    secs = _number(seconds, float, "seconds")
    rate = fps if fps is not None else list_presets().get(preset, {}).get("fps", 24)
    if not 0 < secs <= 600:
        raise ApiError(400, f"seconds {seconds!r}: a duration from 0 to 600", param="seconds")
    return max(1, 4 * round(secs * float(rate) / 4) + 1)


def _query_int(text: str | None, name: str, default: int, low: int, high: int) -> int:
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 6) or not low <= int(text) <= high:
        raise ApiError(400, f"{name} {text[:20]!r}: an integer from {low} to {high}", param=name)
    return int(text)

