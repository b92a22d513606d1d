"""OpenAI's Videos API on the farm, through the `openai` package itself (its client, as the field's
tools call it) against a farm in this process rendering the tiny model: create and create_and_poll
end completed with an mp4 of the job's frames, retrieve / list (paginated) / delete behave as the
package expects, thumbnails and sprite sheets come back as images, a failed render says why with a
failure class, and a bad parameter is a 400 naming it."""

from __future__ import annotations

import io
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import serving_farm

from pan2render.media.video import probe_mp4
from pan2render.runner.protocol.messages import DEFAULT_PIPELINE_FACTORY

openai = pytest.importorskip("openai", reason="the openai package is a test extra (pip install -e '.[test]')")
# Its Videos methods are marked deprecated (OpenAI's own service ends); the client is what we test against.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def farm(tmp_path: Path) -> Iterator[tuple[Any, Any, str, str]]:
    with serving_farm(tmp_path, pipeline=DEFAULT_PIPELINE_FACTORY) as (farm, url, token):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)
        yield farm, client, url, token


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def test_create_and_poll_completes_with_an_mp4_of_the_jobs_frames(farm: Any, tmp_path: Path) -> None:
    _, client, url, _ = farm
    video = client.videos.create_and_poll(prompt="A red fox trots through fresh snow.", model="tiny",
                                          size="64x64", seconds="2", poll_interval_ms=200,
                                          extra_body={"seed": 7, "num_inference_steps": 3})
    assert video.status == "completed" and video.progress == 100 and video.error is None
    assert video.model == "tiny" and video.size == "64x64" and video.prompt.startswith("A red fox")
    extra = video.model_extra or {}
    assert extra["seed"] == 7 and extra["params"]["steps"] == 3 and extra["job_id"]
    frames = extra["params"]["frames"]
    assert frames == 17 and video.seconds == f"{17 / 8:g}"  # 2 s at the preset's 8 fps: 4k+1 frames
    content = client.videos.download_content(video.id)
    mp4 = tmp_path / "fox.mp4"
    mp4.write_bytes(content.content)
    info = probe_mp4(mp4)
    assert (info.frames, info.width, info.height) == (frames, 64, 64)

    thumb = client.videos.download_content(video.id, variant="thumbnail").content
    assert _png_size(thumb) == (64, 64)
    sprite = client.videos.download_content(video.id, variant="spritesheet").content
    width, height = _png_size(sprite)
    assert height == 64 and width == 8 * 64  # eight frames side by side
    raw = client.videos.with_raw_response.retrieve(video.id)
    assert "openai-poll-after-ms" not in raw.headers  # ended: nothing to poll for


def test_retrieve_list_and_delete_behave_as_the_client_expects(farm: Any) -> None:
    the_farm, client, _, _ = farm
    made = [client.videos.create(prompt=f"clip {i}", model="tiny", size="64x64",
                                 extra_body={"num_inference_steps": 2}) for i in range(3)]
    assert all(v.status in ("queued", "in_progress") for v in made)
    raw = client.videos.with_raw_response.retrieve(made[0].id)
    assert int(raw.headers["openai-poll-after-ms"]) > 0 or raw.parse().status == "completed"
    page = client.videos.list(limit=2)
    assert [v.id for v in page.data] == [made[2].id, made[1].id] and page.has_more
    assert [v.id for v in client.videos.list(limit=2)] == [v.id for v in reversed(made)]  # every page, newest first
    assert [v.id for v in client.videos.list(order="asc")] == [v.id for v in made]
    for v in made:
        client.videos.poll(v.id, poll_interval_ms=200)
    gone = client.videos.delete(made[1].id)
    assert gone.deleted and gone.id == made[1].id and gone.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(made[1].id)
    assert [v.id for v in client.videos.list()] == [made[2].id, made[0].id]
    row = the_farm.ask(lambda: the_farm.queue.by_video(made[1].id)).result(timeout=30)
    assert Path(row.out_dir).is_dir()  # deleted from the list; its files stay unless asked (?files=true)


def test_a_failed_render_ends_failed_with_its_failure_class(farm: Any) -> None:
    _, client, _, _ = farm
    # A PNG whose header reads 64x64 but whose data does not decode: validation reads the header,
    # the worker fails to decode it, deterministically.
    broken = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0) \
        + b"\x00" * 4 + b"garbage" * 10
    video = client.videos.create_and_poll(prompt="from a first frame", model="tiny", size="64x64",
                                          input_reference=("frame.png", io.BytesIO(broken), "image/png"),
                                          poll_interval_ms=200)
    assert video.status == "failed" and video.error is not None
    assert video.error.code == "input" and "image" in video.error.message


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"size": "65x64"}, "size"),
    ({"size": "big"}, "size"),
    ({"model": "sora-2"}, "model"),
    ({"extra_body": {"num_inference_steps": 0}}, "num_inference_steps"),
    ({"extra_body": {"guidance_scale": "much"}}, "guidance_scale"),
    ({"extra_body": {"fps": 1000}}, "fps"),
    ({"extra_body": {"nonsense": 1}}, "nonsense"),
])
def test_a_bad_parameter_is_a_400_naming_it(farm: Any, kwargs: dict[str, Any], param: str) -> None:
    the_farm, client, _, _ = farm
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="x", **{"model": "tiny", **kwargs})
    assert refused.value.param == param, refused.value.body
    assert not list(the_farm.videos_root.rglob("*.yaml")) and not the_farm.queue.batches()  # nothing queued


def test_videos_are_their_users_own(tmp_path: Path) -> None:
    users: dict[str, str] = {"ann": "", "bob": ""}
    with serving_farm(tmp_path, users=users) as (_, url, token):
        ann, bob, admin = (openai.OpenAI(base_url=f"{url}/v1", api_key=t, max_retries=0)
                           for t in (users["ann"], users["bob"], token))
        video = ann.videos.create(prompt="ann's", model="tiny", size="64x64")
        with pytest.raises(openai.NotFoundError):
            bob.videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            bob.videos.delete(video.id)
        assert [v.id for v in bob.videos.list()] == [] and [v.id for v in ann.videos.list()] == [video.id]
        assert admin.videos.retrieve(video.id).id == video.id
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="p2r_not-a-token", max_retries=0).videos.list()
        req = urllib.request.Request(f"{url}/v1/videos/{video.id}", headers={"Authorization": f"Bearer {users['ann']}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["openai-poll-after-ms"] or resp.status == 200
