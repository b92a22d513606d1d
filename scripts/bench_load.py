"""Cold-start load: a full-size checkpoint folder onto one GPU, ours against diffusers', one run.

    python scripts/bench_load.py --out DIR [--checkpoint FOLDER] [--rounds 2] [--variants ours,previous]
    python scripts/bench_load.py --out /tmp/bl --tiny        # CPU smoke at toy size

The checkpoint is bench_batch.py's random-weight Wan2.2-TI2V-5B in the diffusers layout (DiT and
VAE fp32, umT5-XXL bf16, sharded; written once, then reused), so every variant reads the same
files, from the page cache (the machine has run a batch; a first read from disk is slower for all).
Each variant loads in a fresh subprocess (its imports and CUDA start not counted), in turn, for
--rounds rounds:

- ``ours``: ``PAN2Pipeline.from_pretrained`` itself (on CUDA every safetensors file streamed
  through pinned buffers into one device buffer, the text encoder built on the meta device);
- ``previous``: the same call with the readers it had before: per-tensor
  ``safe_open(device="cuda").get_tensor`` for the DiT and the VAE, transformers' from_pretrained on
  the CPU then ``.to(device)`` for the text encoder, its import of transformers included (a copy of
  that reader is kept here, not in the library);
- ``components``: the DiT, the VAE and the text encoder one after the other, each timed (what
  ``ours`` does, with the seconds split);
- ``diffusers``: ``WanPipeline`` with a bf16 transformer and an fp32 VAE, moved to the GPU, as
  bench_batch.py's loop loads it.

Prints seconds and GB/s (the weight files' bytes on disk over the seconds) per variant and round,
and writes DIR/bench_load.json. On a fresh machine the first pipeline load may also compile
FlashAttention-4's kernels (then kept on disk), so compare the best of rounds. Results of record:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))  # bench this checkout's pan2render, whichever one is installed
VARIANTS = ("ours", "previous", "components", "diffusers")
COMPONENTS = ("transformer", "vae", "text_encoder")


def weight_bytes(ckpt: Path, component: str | None = None) -> int:
    """Bytes of the safetensors files a load reads: one component's, or all three's."""
    return sum(f.stat().st_size for c in ([component] if component else COMPONENTS)
               for f in (ckpt / c).glob("*.safetensors"))


def previous_read_state_dict(folder: Path, *, prefix: str = "diffusion_pytorch_model", device: Any = "cpu",
                             cast: Any = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """The reader the library had before streaming (the baseline): one ``get_tensor`` per tensor,
    straight onto ``device`` from the memory-mapped file, cast at once."""
    from safetensors import safe_open

    from pan2render.models.loading import ModelFolderError, safetensors_files

    tensors: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    for file in safetensors_files(folder, prefix):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key in tensors:
                        raise ModelFolderError(f"{file}: key '{key}' also appears in {origin[key]}")
                    t = f.get_tensor(key)
                    tensors[key] = t if cast is None else cast(key, t)
                    origin[key] = file
        except ModelFolderError:
            raise
        except Exception as e:
            raise ModelFolderError(f"{file}: cannot read safetensors file ({e})") from e
    return tensors, origin


def previous_umt5_encoder(folder: Path, *, device: Any, dtype: Any) -> Any:
    """The text encoder as the library read it before: transformers' from_pretrained onto the CPU,
    then moved to ``device``."""
    from transformers import UMT5EncoderModel

    model = UMT5EncoderModel.from_pretrained(str(folder), dtype=dtype, use_safetensors=True)
    return model.to(device).eval().requires_grad_(False)


def use_previous_readers() -> None:
    """Swap the baseline readers in where the library looks them up."""
    from pan2render.models import loading, text

    loading.read_state_dict = previous_read_state_dict
    text.load_umt5_encoder = previous_umt5_encoder


def load_once(variant: str, ckpt: Path, device_name: str) -> dict[str, Any]:
    """In the subprocess: load ``ckpt`` one way, return the seconds."""
    import torch

    from pan2render.models.pipeline import PAN2Pipeline, PAN2PipelineConfig, load_dit, load_vae
    from pan2render.models.text import TextEncoder

    if variant in ("previous", "diffusers"):
        # diffusers: bench_batch's hand-made transformer load (where diffusers refuses a bf16 model
        # with fp32 modules) reads through read_state_dict; the baseline reader keeps it diffusers'.
        use_previous_readers()

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context, not counted

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    res: dict[str, Any] = {"variant": variant}
    t0 = time.perf_counter()
    if variant == "components":
        loaded = []  # kept, so each component loads beside the ones before it, as in the pipeline
        last = t0
        for name, folder, load in (
            ("dit", "transformer", lambda: load_dit(ckpt, device=device, dtype=dtype)),
            ("vae", "vae", lambda: load_vae(ckpt, device=device, dtype=torch.float32)),
            ("text_encoder", "text_encoder", lambda: TextEncoder.from_pretrained(ckpt, device=device, dtype=dtype)),
        ):
            loaded.append(load())
            sync()
            seconds = time.perf_counter() - last
            res[f"{name}_s"] = round(seconds, 2)
            res[f"{name}_gb_s"] = round(weight_bytes(ckpt, folder) / 1e9 / seconds, 2)
            last = time.perf_counter()
    elif variant in ("ours", "previous"):
        pipe = PAN2Pipeline.from_pretrained(ckpt, PAN2PipelineConfig(device=str(device), dtype=dtype))
        # FlashAttention-4 imported and its kernel compiled (or loaded from disk), as the load of
        # a batch's group does before its first job (and diffusers' first forward, not timed here).
        pipe.warm_up_attention()
    elif variant == "diffusers":
        from bench_batch import load_diffusers_pipeline

        load_diffusers_pipeline(ckpt, dtype=dtype, device=device)
    else:
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    sync()
    seconds = time.perf_counter() - t0
    res["seconds"] = round(seconds, 2)
    res["gb_s"] = round(weight_bytes(ckpt) / 1e9 / seconds, 2)
    if device.type == "cuda":
        res["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="bench_batch.py's random checkpoint folder (written if missing)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny random checkpoint")
    p.add_argument("--one", nargs=3, metavar=("VARIANT", "CHECKPOINT", "DEVICE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(load_once(args.one[0], Path(args.one[1]), args.one[2])))
        return 0

    import bench_batch

    ckpt = bench_batch.checkpoint(argparse.Namespace(checkpoint=args.checkpoint, tiny=args.tiny))
    device = "cpu" if args.tiny else "cuda:0"
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "checkpoint": str(ckpt),
           "checkpoint_gib": round(sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30, 1),
           "weights_gb": round(weight_bytes(ckpt) / 1e9, 3)}
    print(json.dumps(env), flush=True)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for variant in args.variants.split(","):
            one = [sys.executable, __file__, "--out", str(args.out), "--one", variant, str(ckpt), device]
            proc = subprocess.run(one, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                runs.append({"variant": variant, "round": rnd, "error": proc.stderr.strip().splitlines()[-1:]})
            else:
                runs.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "round": rnd})
            print(json.dumps(runs[-1]), flush=True)
            (args.out / "bench_load.json").write_text(json.dumps({"env": env, "runs": runs}, indent=1))
    best = {v: min((r["seconds"] for r in runs if r["variant"] == v and "seconds" in r), default=None)
            for v in args.variants.split(",")}
    print("best of rounds, s:", json.dumps(best))
    print("best of rounds, GB/s:", json.dumps({v: sec and round(weight_bytes(ckpt) / 1e9 / sec, 2)
                                               for v, sec in best.items()}))
    for other in ("previous", "diffusers"):
        if best.get("ours") and best.get(other):
            print(f"{other} / ours: x{best[other] / best['ours']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
