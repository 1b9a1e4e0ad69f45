"""Install the GPU extras that scripts/stage_gpu_extras.py packed into .gpu_extras_N/ folders, on
a GPU machine without a package index (standard library only; run from the checkout):

    python3 scripts/install_gpu_extras.py            # every group whose files are all here
    python3 scripts/install_gpu_extras.py --check    # only say what is here and what is missing

Reads MANIFEST.json from any .gpu_extras_*/ folder present, joins each file's chunks (checking its
sha256), turns a .whl.tar.xz back into its wheel, and installs with
`pip install --no-index --no-deps --no-compile` every group of scripts/gpu_extras.txt whose
wheels are all complete and not installed yet at that version. A group with a chunk missing is
named with the folder that holds it: upload that folder (the folders already here stay) and run
this again. Exit status: 0 when every staged group is installed, 3 when some still miss chunks,
1 on an error (a checksum that does not match, pip failing).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # no paths outside the folder


def manifest(prefix: str) -> Dict:
    for path in sorted(glob.glob(prefix + "*/MANIFEST.json")):
        with open(path) as f:
            return json.load(f)
    return {}


def installed(wheel: str) -> bool:
    name, version = wheel.split("-")[:2]
    try:
        return metadata.version(name.replace("_", "-")) == version
    except metadata.PackageNotFoundError:
        return False


def assemble(entry: Dict, prefix: str, work: str) -> str:
    """The wheel of a manifest entry, built in `work` from its chunks; raises on a bad checksum."""
    payload = os.path.join(work, entry["file"])
    h = hashlib.sha256()
    with open(payload, "wb") as out:
        for chunk in entry["chunks"]:
            with open(os.path.join(f"{prefix}{chunk['part']}", chunk["name"]), "rb") as f:
                data = f.read()
            h.update(data)
            out.write(data)
    if h.hexdigest() != entry["sha256"]:
        raise RuntimeError(f"{entry['file']}: sha256 differs from the manifest's (a partial upload?)")
    if entry["packed"] == "whl":
        return payload
    wheel = os.path.join(work, entry["wheel"])
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        with lzma.open(payload) as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
            names = []
            for member in tar:
                tar.extract(member, tmp, **SAFE)
                names.append(member.name)
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:   # stored: pip unpacks it at once
            for name in names:                   # the wheel's entries, its folders too
                z.write(os.path.join(tmp, name), name)
    os.remove(payload)
    return wheel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--prefix", default=os.path.join(ROOT, ".gpu_extras_"), help="the folders' prefix")
    p.add_argument("--check", action="store_true", help="report only; install nothing")
    p.add_argument("--python", default=sys.executable, help="the Python to install into")
    a = p.parse_args(argv)
    man = manifest(a.prefix)
    if not man:
        print(f"no {os.path.relpath(a.prefix, ROOT)}*/MANIFEST.json here: nothing staged "
              "(scripts/stage_gpu_extras.py makes these folders)")
        return 3
    here = {os.path.basename(d)[len(os.path.basename(a.prefix)):] for d in glob.glob(a.prefix + "*")}
    groups: Dict[str, List[Dict]] = {}
    for entry in man["files"]:
        groups.setdefault(entry["group"], []).append(entry)
    missing_any, todo = False, []
    for group, entries in groups.items():
        absent = sorted({c["part"] for e in entries for c in e["chunks"]
                         if str(c["part"]) not in here
                         or not os.path.exists(f"{a.prefix}{c['part']}/{c['name']}")})
        if absent:
            missing_any = True
            print(f"{group}: waits for {', '.join(f'{os.path.basename(a.prefix)}{n}/' for n in absent)}")
            continue
        new = [e for e in entries if not installed(e["wheel"])]
        print(f"{group}: complete; " + (f"{len(new)} of {len(entries)} wheels to install" if new
                                        else "installed"))
        todo += new
    if a.check or not todo:
        return 3 if missing_any else 0
    with tempfile.TemporaryDirectory(prefix="cp_softcap_wheels_") as work:
        wheels = [assemble(e, a.prefix, work) for e in todo]
        cmd = [a.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               *wheels]
        print("$", " ".join(cmd[:8]), f"... ({len(wheels)} wheels)", flush=True)
        if subprocess.run(cmd).returncode != 0:
            return 1
    for e in todo:
        print(("installed " if installed(e["wheel"]) else "NOT installed ") + e["wheel"])
    return 3 if missing_any else 0


if __name__ == "__main__":
    sys.exit(main())
