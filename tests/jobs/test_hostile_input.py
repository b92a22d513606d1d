"""Hostile or broken batch files: each is refused in milliseconds with exit 2, file:line, the field
and what is allowed, never a traceback, a hang or a worker run out of memory."""

from __future__ import annotations

import os
import struct
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest

from pan2render.jobs.inputs import LIMITS
from pan2render.runner.cli import main as cli

pytestmark = pytest.mark.timeout(20)

HEADER = "model: tiny\npreset: tiny-preview\n"

# Nine levels of nine aliases each: 9**9 (~387 million) strings once expanded.
BOMB = textwrap.dedent("""\
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
    """)


def _run(tmp_path: Path, text: str | bytes, capsys: pytest.CaptureFixture[str]) -> str:
    """`validate` and `run` both refuse the batch with exit 2, write nothing; returns stderr."""
    batch = tmp_path / "batch.yaml"
    batch.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    t0 = time.perf_counter()
    assert cli.main(["validate", str(batch)]) == 2
    assert cli.main(["run", str(batch), "--out", str(out)]) == 2
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err
    print(f"({seconds:.3f} s)\n{err}")
    assert "Traceback" not in err and not out.exists()
    return err


@pytest.mark.parametrize("where", ["prompt", "preset", "sweep", "key"])
def test_alias_bomb_is_refused_with_its_line(tmp_path: Path, where: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    use = {"prompt": "jobs:\n  - prompt: *i\n",
           "preset": "model: tiny\npreset: *i\njobs: [a fox]\n",
           "sweep": HEADER + "jobs: [a fox]\nsweep:\n  seed: *i\n",
           "key": HEADER + "jobs: [a fox]\n? *i\n: 1\n"}[where]
    text = BOMB + (use if where != "prompt" else HEADER + use)
    err = _run(tmp_path, text, capsys)
    # The smallest value past the limit is `f` (9**6 values, line 6): that line is named.
    assert f"batch.yaml:6: (yaml): the value written here expands through aliases to more than " \
           f"{LIMITS.yaml_values:,} values" in err


def test_too_many_alias_references(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = ", ".join(["*p"] * (LIMITS.yaml_aliases + 1))
    err = _run(tmp_path, HEADER + f"x: &p 1\nl: [{refs}]\njobs: [a fox]\n", capsys)
    # Named at the anchor (line 3): an alias node is the anchored node itself once composed.
    assert "batch.yaml:3: (yaml): more than 1000 alias references" in err


@pytest.mark.parametrize("field", ["image", "model", "prompts_file", "prompt", "name"])
def test_nul_in_a_path_or_text_field(tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    value = '"a\\0b.png"'  # a YAML escape: the value holds a real NUL
    if field == "model":
        text = f"model: {value}\npreset: tiny-preview\njobs: [a fox]\n"
        line, label = 1, "model"
    elif field == "prompts_file":
        text = HEADER + f"prompts_file: {value}\n"
        line, label = 3, "prompts_file"
    else:
        other = "" if field == "prompt" else "    prompt: a fox\n"
        text = HEADER + f"jobs:\n  - {field}: {value}\n{other}"
        line, label = 4, f"jobs[0].{field}"
    err = _run(tmp_path, text, capsys)
    assert f"batch.yaml:{line}: {label}: holds the control character U+0000 (NUL)" in err


def test_raw_control_characters_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, (HEADER + "jobs:\n  - prompt: a f\x00ox\n  - prompt: ok\x07\n").encode(), capsys)
    assert "batch.yaml:4: (yaml): control character U+0000 (NUL) at column 16" in err
    assert "batch.yaml:5: (yaml): control character U+0007 at column 15" in err


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "huge"])
def test_prompts_file_must_be_a_bounded_regular_file(tmp_path: Path, kind: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "prompts.txt"
    if kind == "dev-zero":
        target = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(target)  # nobody ever writes to it: reading it would block forever
    elif kind == "folder":
        target.mkdir()
    else:
        with open(target, "wb") as f:
            f.truncate(LIMITS.prompts_file_bytes + 1)  # sparse: no disk used
    err = _run(tmp_path, HEADER + f"prompts_file: {target}\n", capsys)
    expected = {"dev-zero": "is a device", "fifo": "is a FIFO", "folder": "is a folder",
                "huge": f"is {LIMITS.prompts_file_bytes + 1:,} bytes; allowed: at most"}[kind]
    assert "batch.yaml:3: prompts_file: prompts file" in err and expected in err


def _png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk claiming width x height (enough for every header reader)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


@pytest.mark.parametrize("kind", ["huge-pixels", "fifo", "not-an-image"])
def test_image_must_be_a_small_regular_image_file(tmp_path: Path, kind: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "first.png"
    if kind == "huge-pixels":
        image.write_bytes(_png_header(16000, 16000) + b"\x00" * 100)
    elif kind == "fifo":
        os.mkfifo(image)
    else:
        image.write_bytes(b"GIF89a not what we take")
    err = _run(tmp_path, HEADER + "jobs:\n  - prompt: a fox\n    image: first.png\n", capsys)
    expected = {"huge-pixels": "is 16000x16000 = 256,000,000 pixels (decoding it needs 0.7 GiB)",
                "fifo": "is a FIFO", "not-an-image": "is not a PNG, JPEG or WebP image"}[kind]
    assert "batch.yaml:5: jobs[0].image:" in err and expected in err


def _load_within(seconds: float, batch: Path) -> str:
    """What `load_batch` says of ``batch`` (its problems, or "ok"), failing the test if it has not
    returned within ``seconds``: a validation that blocks on a file fails instead of hanging."""
    from pan2render.jobs.batch import load_batch
    from pan2render.jobs.spec import BatchValidationError

    said: list[str] = []

    def load() -> None:
        try:
            load_batch(batch)
            said.append("ok")
        except BatchValidationError as exc:
            said.append(str(exc))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"validation still blocked after {seconds} s"
    print(said[0])
    return said[0]


@pytest.mark.parametrize("kind", ["batch", "prompts_file", "image", "sweep-image", "lora", "model-config"])
def test_a_fifo_anywhere_a_batch_names_a_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    """Nobody ever writes to these FIFOs: a read that waited for a writer would wait forever."""
    fifo = tmp_path / {"batch": "batch.yaml", "prompts_file": "prompts.txt", "image": "first.png",
                       "sweep-image": "first.png", "lora": "style.safetensors",
                       "model-config": "ckpt/transformer/config.json"}[kind]
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    batch = tmp_path / "batch.yaml"
    if kind == "model-config":  # read to check LoRAs against the DiT's layers
        (tmp_path / "ckpt" / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
        batch.write_text("model: ckpt\npreset: tiny-preview\njobs: [a fox]\n")
    elif kind != "batch":
        batch.write_text(HEADER + {
            "prompts_file": "prompts_file: prompts.txt\n",
            "image": "jobs:\n  - prompt: a fox\n    image: first.png\n",
            "sweep-image": "jobs: [a fox]\nsweep:\n  image: [first.png]\n",
            "lora": "jobs:\n  - prompt: a fox\n    loras: [style.safetensors]\n"}[kind])
    try:
        said = _load_within(10, batch)
    finally:  # let a reader stuck on the FIFO go: a writer that opens and closes gives it end-of-file
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reading it
            pass
    if kind != "model-config":  # the model's own check reports that one, before a run starts
        assert f"{fifo}' is a FIFO (named pipe); allowed: a regular file" in said


@pytest.mark.parametrize("line, fragment", [
    ("steps: 1000000000", "jobs[0].steps: got 1000000000; allowed: an integer from 1 to 1000"),
    ("width: 32768", "jobs[0].width: got 32768; allowed: a positive multiple of 32 (VAE 16x times DiT patch 2) "
                     "up to 4096"),
    ("frames: 481\n    width: 1920\n    height: 1088",
     "frames x height x width: job 'big' asks for 481 frames of 1920x1088 = 246,840 DiT tokens; allowed: at most "
     "131,072 tokens"),
])
def test_job_cost_is_bounded_with_the_reason(tmp_path: Path, line: str, fragment: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, HEADER + f"jobs:\n  - name: big\n    prompt: a fox\n    {line}\n", capsys)
    assert "batch.yaml:" in err and fragment in err


def test_a_sweep_that_expands_past_the_job_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seeds = list(range(200))
    err = _run(tmp_path, HEADER + f"jobs: [a fox]\nsweep:\n  seed: {seeds}\n  crf: {list(range(52))}\n"
                                  f"  fps: {list(range(1, 3))}\n", capsys)
    assert "batch.yaml:4: sweep: the batch expands to 20,800 jobs" in err and "at most 20,000" in err


# ------------------------------------------------------------ every input path gets the same checks
def _flag_run(tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """A valid batch refused through its command-line flags alone: exit 2 from validate and run."""
    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + "jobs: [a fox]\n")
    out = tmp_path / "out"
    assert cli.main(["validate", str(batch), *flags]) == 2
    assert cli.main(["run", str(batch), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "Traceback" not in err and not out.exists()
    return err


@pytest.mark.parametrize("char, shown", [("\x00", "U+0000 (NUL)"), ("\x1b", "U+001B"), ("\x0b", "U+000B")])
def test_a_txt_prompts_file_line_gets_the_checks_a_yaml_prompt_gets(
        tmp_path: Path, char: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "prompts.txt").write_bytes(f"a calm lake\nA red{char} fox\n".encode())
    err = _run(tmp_path, HEADER + "prompts_file: prompts.txt\n", capsys)
    assert f"prompts.txt:2: prompts_file[1].prompt: holds the control character {shown}" in err


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc/self/status"])
def test_a_proc_file_is_not_a_prompts_file(tmp_path: Path, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """/proc files call themselves regular: read as prompts, they put the process environment into
    the ledger, params.json, the report and the mp4 tags."""
    err = _run(tmp_path, HEADER + f"prompts_file: {path}\n", capsys)
    assert "batch.yaml:3: prompts_file: prompts file '/proc/" in err and "allowed: a regular file" in err
    assert os.environ.get("PATH", "PATH=") not in err


@pytest.mark.parametrize("where", ["yaml", "jsonl", "set", "sweep"])
def test_a_lone_surrogate_is_refused_at_validation(tmp_path: Path, where: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """An unpaired UTF-16 half validates, then fails the job at encode and `report` for the folder."""
    if where == "yaml":
        err = _run(tmp_path, HEADER + 'jobs:\n  - prompt: "a \\ud800 fox"\n', capsys)
        assert "batch.yaml:4: jobs[0].prompt: holds a lone surrogate U+D800 at position 2" in err
    elif where == "jsonl":
        (tmp_path / "rows.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "a fox", "name": "x\\udfff"}\n')
        err = _run(tmp_path, HEADER + "prompts_file: rows.jsonl\n", capsys)
        assert "rows.jsonl:2: prompts_file[1].name: holds a lone surrogate U+DFFF at position 1" in err
    else:
        # Bytes that are not UTF-8 on the command line reach Python as lone surrogates.
        flag = ["--set", "negative_prompt=bad\udcff"] if where == "set" else ["--sweep", "negative_prompt=ok,x\udcff"]
        err = _flag_run(tmp_path, flag, capsys)
        assert "negative_prompt" in err and "holds a lone surrogate U+DCFF" in err


RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: RLO + "gnp.exe" shows as "exe.png"


@pytest.mark.parametrize("where", ["yaml-raw", "yaml-escape", "negative_prompt", "image", "jsonl", "txt", "set",
                                   "sweep"])
def test_a_bidirectional_control_is_refused_with_its_field(tmp_path: Path, where: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A job named RLO + "gnp.exe" showed as "exe.png" in the monitor and the report."""
    if where == "yaml-raw":
        err = _run(tmp_path, HEADER + f"jobs:\n  - prompt: a fox\n    name: {RLO}gnp.exe\n", capsys)
        expected = "batch.yaml:5: jobs[0].name: holds the bidirectional control U+202E (RIGHT-TO-LEFT OVERRIDE)"
    elif where == "yaml-escape":
        err = _run(tmp_path, HEADER + 'jobs:\n  - prompt: "a \\u2066fox"\n', capsys)
        expected = "batch.yaml:4: jobs[0].prompt: holds the bidirectional control U+2066 (LEFT-TO-RIGHT ISOLATE)"
    elif where == "negative_prompt":
        err = _run(tmp_path, HEADER + 'defaults:\n  negative_prompt: "blur\\u202b"\njobs: [a fox]\n', capsys)
        expected = "batch.yaml:4: defaults.negative_prompt: holds the bidirectional control U+202B"
    elif where == "image":
        err = _run(tmp_path, HEADER + f"jobs:\n  - prompt: a fox\n    image: {RLO}gnp.png\n", capsys)
        expected = "batch.yaml:5: jobs[0].image: holds the bidirectional control U+202E"
    elif where == "jsonl":
        (tmp_path / "rows.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "a fox", "name": "x\\u200fy"}\n')
        err = _run(tmp_path, HEADER + "prompts_file: rows.jsonl\n", capsys)
        expected = "rows.jsonl:2: prompts_file[1].name: holds the bidirectional control U+200F (RIGHT-TO-LEFT MARK)"
    elif where == "txt":
        (tmp_path / "prompts.txt").write_text("a calm lake\nA red \u061cfox\n", encoding="utf-8")
        err = _run(tmp_path, HEADER + "prompts_file: prompts.txt\n", capsys)
        expected = "prompts.txt:2: prompts_file[1].prompt: holds the bidirectional control U+061C (ARABIC LETTER MARK)"
    else:
        flag = f"negative_prompt={RLO}gnp.exe" if where == "set" else f"negative_prompt=ok,x{RLO}"
        err = _flag_run(tmp_path, [f"--{where}", flag], capsys)
        expected = "holds the bidirectional control U+202E (RIGHT-TO-LEFT OVERRIDE)"
        assert "\\u202e" in err  # the flag, as the message locates it, is shown escaped
    assert expected in err and "allowed:" in err
    assert RLO not in err  # nothing in the message is reordered


@pytest.mark.parametrize("char", ["\u061c", "\u200e", "\u200f", *map(chr, range(0x202A, 0x202F)),
                                  *map(chr, range(0x2066, 0x206A))])
def test_every_bidirectional_control_is_refused(tmp_path: Path, char: str) -> None:
    from pan2render.jobs.batch import load_batch
    from pan2render.jobs.spec import BatchValidationError

    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + f'jobs:\n  - prompt: "a \\u{ord(char):04x} fox"\n')
    with pytest.raises(BatchValidationError, match=f"U\\+{ord(char):04X}"):
        load_batch(batch)


def test_text_in_right_to_left_scripts_is_accepted(tmp_path: Path) -> None:
    """Negative control: Arabic and Hebrew letters are bidirectional text, not controls."""
    from pan2render.jobs.batch import load_batch

    cat, arabic_cat = "\u05d7\u05ea\u05d5\u05dc", "\u0642\u0637"
    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + f"jobs:\n  - prompt: {arabic_cat} {cat}\n    name: {cat}\n", encoding="utf-8")
    (job,) = load_batch(batch).jobs
    assert job.name == cat


def test_a_surrogate_pair_written_as_two_escapes_is_one_character(tmp_path: Path) -> None:
    from pan2render.jobs.batch import load_batch

    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + 'jobs:\n  - prompt: "a \\ud83e\\udd8a"\n')
    (job,) = load_batch(batch).jobs
    assert job.prompt == "a \U0001f98a"


@pytest.mark.parametrize("where", ["yaml-flow", "yaml-block", "jsonl", "set"])
def test_deep_nesting_is_a_problem_with_its_line_not_a_crash(tmp_path: Path, where: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    deep = "[" * 5000 + "]" * 5000
    if where == "yaml-flow":
        err = _run(tmp_path, HEADER + f"jobs: [a fox]\nsweep:\n  seed: {deep}\n", capsys)
        assert "batch.yaml:5: (yaml): values nested more than" in err
    elif where == "yaml-block":
        block = "".join("  " * i + "- \n" for i in range(2000))
        err = _run(tmp_path, HEADER + "jobs: [a fox]\nx:\n" + block, capsys)
        assert f"(yaml): values nested more than {LIMITS.nesting} levels deep" in err
    elif where == "jsonl":
        (tmp_path / "rows.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "a fox", "timesteps": ' + deep + "}\n")
        err = _run(tmp_path, HEADER + "prompts_file: rows.jsonl\n", capsys)
        assert f"rows.jsonl:2: prompts_file[1]: values nested more than {LIMITS.nesting} levels deep" in err
    else:
        err = _flag_run(tmp_path, ["--set", f"seed={deep}"], capsys)
        assert f"--set seed={deep[:20]}" in err and f"nested more than {LIMITS.nesting} levels" in err
    assert "likely a bug" not in err and "RecursionError" not in err


@pytest.mark.parametrize("line, fragment", [
    ("frames: 100001", "jobs[0].frames: got 100001; allowed: 4k+1 frames"),
    ("guidance: 1.0e+300", "jobs[0].guidance: got 1e+300; allowed: a number from 1.0 to"),
    ("flow_shift: 1.0e+300", "jobs[0].flow_shift: got 1e+300; allowed: a number > 0"),
])
def test_values_a_worker_cannot_render_are_refused(tmp_path: Path, line: str, fragment: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    err = _run(tmp_path, HEADER + f"jobs:\n  - name: big\n    prompt: a fox\n    {line}\n", capsys)
    assert "batch.yaml:6: " + fragment in err


def test_the_longest_video_the_positional_table_holds_is_accepted(tmp_path: Path) -> None:
    from pan2render.jobs.batch import load_batch
    from pan2render.jobs.spec import RULES
    from pan2render.sampling import WAN22

    longest = RULES["frames"].max
    assert WAN22.latent_frames(int(longest)) // WAN22.patch[0] == WAN22.rope_extent
    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + f"jobs:\n  - prompt: a fox\n    frames: {longest}\n    width: 32\n    height: 32\n")
    assert load_batch(batch).jobs[0].frames == longest


@pytest.mark.parametrize("how", ["yaml", "set", "sweep"])
@pytest.mark.parametrize("size, ok", [((4096, 4096), True), ((4097, 4096), False), ((16000, 16000), False)])
def test_the_image_checks_apply_to_every_way_of_naming_an_image(
        tmp_path: Path, how: str, size: tuple[int, int], ok: bool, capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "first.png"
    image.write_bytes(_png_header(*size) + b"\x00" * 100)
    batch = tmp_path / "batch.yaml"
    job = "  - prompt: a fox\n" + ("    image: first.png\n" if how == "yaml" else "")
    batch.write_text(HEADER + "jobs:\n" + job)
    flags = {"yaml": [], "set": ["--set", f"image={image}"], "sweep": ["--sweep", f"image={image}"]}[how]
    code = cli.main(["validate", str(batch), *flags])
    err = capsys.readouterr().err
    print(err)
    assert code == (0 if ok else 2)
    if not ok:
        assert f"is {size[0]}x{size[1]} = {size[0] * size[1]:,} pixels" in err
        assert f"{LIMITS.image_pixels:,} pixels, relative to" in err


@pytest.mark.parametrize("field, value, allowed", [
    ("prompt", "x" * (LIMITS.text_chars + 1), f"at most {LIMITS.text_chars:,} characters"),
    ("negative_prompt", "y" * 1_000_000, f"at most {LIMITS.text_chars:,} characters"),
    ("name", "n" * (LIMITS.name_chars + 1), f"at most {LIMITS.name_chars:,} characters"),
    ("image", "p" * (LIMITS.path_chars + 1), f"at most {LIMITS.path_chars:,} characters"),
])
def test_string_fields_are_bounded(tmp_path: Path, field: str, value: str, allowed: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A 1 MB prompt swept over 500 seeds made a 1.24 GB ledger and ran the driver out of memory."""
    other = "" if field == "prompt" else "    prompt: a fox\n"
    err = _run(tmp_path, HEADER + f"jobs:\n  - {field}: {value}\n{other}", capsys)
    assert f"batch.yaml:4: jobs[0].{field}: is {len(value):,} characters long; allowed:" in err and allowed in err
    assert value not in err  # the value is not echoed back


def test_a_prompt_of_the_longest_length_is_accepted(tmp_path: Path) -> None:
    from pan2render.jobs.batch import load_batch

    batch = tmp_path / "batch.yaml"
    batch.write_text(HEADER + f"jobs:\n  - prompt: {'z' * LIMITS.text_chars}\n")
    assert len(load_batch(batch).jobs[0].prompt) == LIMITS.text_chars


@pytest.mark.parametrize("where", ["yaml", "jsonl", "set"])
def test_a_number_too_long_to_read_is_a_problem_not_a_crash(tmp_path: Path, where: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    digits = "1" + "0" * 5000  # past what Python converts from text
    if where == "yaml":
        err = _run(tmp_path, HEADER + f"jobs:\n  - prompt: a fox\n    seed: {digits}\n", capsys)
        assert "batch.yaml:5: (yaml): this value cannot be read as a number" in err
    elif where == "jsonl":
        (tmp_path / "rows.jsonl").write_text('{"prompt": "a fox", "seed": ' + digits + "}\n")
        err = _run(tmp_path, HEADER + "prompts_file: rows.jsonl\n", capsys)
        assert "rows.jsonl:1: prompts_file[0]: this value cannot be read as a number" in err
    else:
        err = _flag_run(tmp_path, ["--set", f"seed={digits}"], capsys)
        assert "seed: this value cannot be read as a number" in err
    assert "likely a bug" not in err


def test_a_lora_path_is_bounded_like_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long = "l" * (LIMITS.path_chars + 1)
    err = _run(tmp_path, HEADER + f"jobs:\n  - prompt: a fox\n    loras: [{long}]\n", capsys)
    assert f"jobs[0].loras: [0]: is {len(long):,} characters long" in err and long not in err
