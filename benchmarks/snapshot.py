"""A read-only snapshot of a store that another process is still writing, with its sketch: to time
`emllm ask` at an intermediate size (e.g. 512k tokens of a 1M-token ingest) without a second ingest.

    python -m benchmarks.snapshot /var/tmp/m1/store /var/tmp/m1/at512k [--no-sketch]

The array files are hard-linked (they are append-only: the snapshot's manifest names the rows
committed when it was taken, and readers never look past them); the manifest and the state file
it names are taken together (retried if a commit deletes the state file in between), and the
running job is cut at that commit (marked complete, so it can be asked). The
snapshot's sketch is then fitted and written by the store's own code (`Store.update_sketch`),
into new files of the snapshot only. The snapshot is never opened as a writer: a writer truncates
uncommitted tails, which, through the hard links, would cut the running ingest's files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from emllm.store import MANIFEST, Store


def snapshot(src: Path, dst: Path) -> None:
    for _ in range(20):
        manifest = (src / MANIFEST).read_bytes()
        state = json.loads(manifest)["state"]["file"]
        dst.mkdir(parents=True)
        try:
            os.link(src / state, dst / state)
        except FileNotFoundError:  # a commit replaced it meanwhile: take the new manifest
            shutil.rmtree(dst)
            time.sleep(0.5)
            continue
        (dst / MANIFEST).write_bytes(manifest)
        (dst / "layers").mkdir()
        for p in src.rglob("*"):
            rel = p.relative_to(src)
            # array files and a sketch's files are append-only, its basis written once
            if p.is_file() and (p.suffix in (".i32", ".f32", ".u8", ".k", ".v", ".r", ".p", ".n")
                                or p.name.startswith("sketch") and p.name.endswith(".safetensors")):
                os.link(p, dst / rel)
        return
    raise SystemExit("the store kept changing: no consistent snapshot")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src, dst = Path(args[0]), Path(args[1])
    snapshot(src, dst)
    t = time.perf_counter()
    with Store.open(dst) as st:  # validated as any reader does
        st.writable = True  # only for the sketch's own new files (see the docstring)
        if "--no-sketch" not in sys.argv:
            st.update_sketch()
        else:  # every ask scans the representative keys, as before sketches (its files stay, unnamed)
            st.manifest.pop("sketch", None)
        # The snapshot ends at its last commit: the rest of the running job is not part of it.
        st.manifest["job"] = {**st.manifest["job"], "tokens": st.manifest["job"]["done"], "complete": True}
        st._write_manifest()
        m = st.manifest
    print(json.dumps({"tokens": m["rows"]["tokens"], "events": m["rows"]["events"], "sketch": bool(m.get("sketch")),
                      "sketch_seconds": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
