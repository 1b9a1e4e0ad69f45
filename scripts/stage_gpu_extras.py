"""Download the GPU extras' wheels and pack them into folders small enough to upload, for a GPU
machine that has torch but no package index (docs/gpu.md). Run it where pip reaches an index:

    python scripts/stage_gpu_extras.py                       # every group of scripts/gpu_extras.txt
    python scripts/stage_gpu_extras.py --fa2 path/to/flash_attn-2.8.3.post2-...whl
    python scripts/stage_gpu_extras.py --groups fa4 liger --part-mib 48

1. `pip download --no-deps --only-binary=:all:` of every pinned wheel of scripts/gpu_extras.txt
   for CPython 3.12 on manylinux x86_64 into .gpu_wheels/ (git-ignored; files already there are
   kept). flash-attn 2 has no wheel for the GPU machine's torch on the index: --fa2 copies one in,
   or scripts/build_fa2_wheel.sh builds one into .gpu_wheels/ (35-90 minutes); without one the fa2
   group is left out, with a note.
2. Wheels above --recompress-mib are repacked as .whl.tar.xz: xz takes the CUDA libraries inside
   about a third smaller than the wheel's zip (flash-attn-4's CUTLASS library: 92 -> 64 MB), at
   the price of some minutes here; the install script zips them back into the same wheel.
3. The files are packed into folders .gpu_extras_1/, .gpu_extras_2/, ... (git-ignored) of at most
   --part-mib MiB each: whole files first, the largest split into numbered chunks where it does
   not fit. Each folder holds MANIFEST.json (every file, its chunks, their folders and the
   sha256 of each whole file), so any folder tells the installer what the others hold.

Upload the folders to the GPU machine's checkout (one per transfer if transfers are limited: a
folder with its MANIFEST.json is self-describing) and run scripts/install_gpu_extras.py there.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIST = os.path.join(ROOT, "scripts", "gpu_extras.txt")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64", "any")
MIB = 1 << 20


def read_groups(path: str = LIST) -> Dict[str, List[str]]:
    """{group: [requirement, ...]} from gpu_extras.txt ('#' comments, [group] headers)."""
    groups: Dict[str, List[str]] = {}
    current = None
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1], [])
        elif current is None:
            raise ValueError(f"{path}: {line!r} before any [group]")
        else:
            current.append(line)
    return groups


def normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def find_wheel(folder: str, requirement: str) -> str:
    """The wheel of 'name==version' in folder (a local version label may follow), or ''."""
    name, version = requirement.split("==")
    for path in glob.glob(os.path.join(folder, "*.whl")):
        parts = os.path.basename(path).split("-")       # a wheel's name has no '-' inside
        if normalized(parts[0]) == normalized(name) and parts[1].split("+")[0] == version:
            return path
    return ""


def download(requirements: List[str], folder: str, python: str) -> None:
    missing = [r for r in requirements if not find_wheel(folder, r)]
    if not missing:
        return
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", "-d", folder]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    print("$", " ".join(cmd + missing), flush=True)
    subprocess.run(cmd + missing, check=True)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def recompress(wheel: str, work: str) -> str:
    """The wheel's files as a .whl.tar.xz in `work` (kept there across runs)."""
    target = os.path.join(work, os.path.basename(wheel) + ".tar.xz")
    if os.path.exists(target) and os.path.getmtime(target) >= os.path.getmtime(wheel):
        return target
    print(f"recompressing {os.path.basename(wheel)} with xz (minutes)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
            names = z.namelist()             # the wheel's order: its RECORD stays last
        partial = target + ".part"
        with lzma.open(partial, "wb", preset=9) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            for name in names:
                tar.add(os.path.join(tmp, name), arcname=name, recursive=False)
        os.replace(partial, target)
    return target


def pack(files: List[Tuple[str, str, str]], part_bytes: int, prefix: str) -> List[str]:
    """Distribute (group, wheel name, payload path) into folders <prefix>1, <prefix>2, ... of at
    most part_bytes each; returns the folders. Whole files first (smallest first, so the groups
    that fit complete in the first folder), a file that does not fit split into chunks."""
    for old in glob.glob(prefix + "*"):
        shutil.rmtree(old)
    files = sorted(files, key=lambda f: os.path.getsize(f[2]))
    parts: List[int] = [0]
    manifest = []
    for group, wheel, payload in files:
        size = os.path.getsize(payload)
        entry = {"group": group, "wheel": wheel, "file": os.path.basename(payload),
                 "packed": "tar.xz" if payload.endswith(".tar.xz") else "whl",
                 "size": size, "sha256": sha256(payload), "chunks": []}
        with open(payload, "rb") as src:
            left = size
            while left:
                room = part_bytes - parts[-1]
                if parts[-1] and (room <= 0 or (room < left and room < min(MIB, part_bytes // 8))):
                    parts.append(0)                 # no useful room left: the next folder
                    continue
                take = min(room, left)
                part = len(parts)
                folder = f"{prefix}{part}"
                os.makedirs(folder, exist_ok=True)
                name = entry["file"] if take == size else f"{entry['file']}.{len(entry['chunks']):03d}"
                with open(os.path.join(folder, name), "wb") as dst:
                    dst.write(src.read(take))
                entry["chunks"].append({"part": part, "name": name, "size": take})
                parts[-1] += take
                left -= take
        manifest.append(entry)
    folders = [f"{prefix}{i + 1}" for i in range(len(parts)) if parts[i]]
    for folder in folders:
        with open(os.path.join(folder, "MANIFEST.json"), "w") as f:
            json.dump({"parts": len(folders), "prefix": os.path.basename(prefix),
                       "files": manifest}, f, indent=1)
    return folders


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--groups", nargs="+", default=None, help="groups of gpu_extras.txt (default: all)")
    p.add_argument("--fa2", help="a flash-attn 2 wheel built for the GPU machine's torch")
    p.add_argument("--part-mib", type=float, default=48.0,
                   help="largest folder, MiB (what one transfer carries, less the checkout)")
    p.add_argument("--recompress-mib", type=float, default=16.0,
                   help="repack wheels larger than this as .tar.xz (0: never)")
    p.add_argument("--wheels", default=os.path.join(ROOT, ".gpu_wheels"), help="download folder")
    p.add_argument("--prefix", default=os.path.join(ROOT, ".gpu_extras_"), help="output folders' prefix")
    p.add_argument("--python", default=sys.executable, help="the Python whose pip downloads")
    a = p.parse_args(argv)
    groups = read_groups()
    chosen = a.groups or list(groups)
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        p.error(f"unknown group(s) {unknown}; gpu_extras.txt has {list(groups)}")
    os.makedirs(a.wheels, exist_ok=True)
    if a.fa2:
        shutil.copy2(a.fa2, a.wheels)
    files = []
    for group in chosen:
        if group == "fa2":                    # built, not downloaded
            found = [find_wheel(a.wheels, r) for r in groups[group]]
            if not all(found):
                print(f"fa2: no {groups[group]} wheel in {a.wheels}: left out (pass --fa2 WHEEL, "
                      "or build one with scripts/build_fa2_wheel.sh)", flush=True)
                continue
        else:
            download(groups[group], a.wheels, a.python)
            found = [find_wheel(a.wheels, r) for r in groups[group]]
        for wheel in found:
            payload = wheel
            if a.recompress_mib and os.path.getsize(wheel) > a.recompress_mib * MIB:
                payload = recompress(wheel, a.wheels)
            files.append((group, os.path.basename(wheel), payload))
    folders = pack(files, int(a.part_mib * MIB), a.prefix)
    for folder in folders:
        size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*")))
        names = sorted(n for n in os.listdir(folder) if n != "MANIFEST.json")
        print(f"{os.path.relpath(folder, ROOT)}/: {size / MIB:.1f} MiB: {', '.join(names)}")
    print("next, on the GPU machine (from the checkout): python3 scripts/install_gpu_extras.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
