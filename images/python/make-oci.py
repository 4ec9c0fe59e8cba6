"""Packs the Python reference harness as an OCI image layout, from what this Debian machine
has: its python3 with the standard library and the shared libraries they load, grpcio and
protobuf (from agentvm's venv, which scripts/setup.sh makes), the stubs generated from
proto/api, and harness.py. No registry is contacted.

    make-oci.py --venv DIR --out LAYOUT

Two layers: the Python runtime (its own, so images of other Python harnesses could share
it), then the harness. Entrypoint runs harness.py as user `harness` (uid 1000).
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# Parts of the standard library a harness never needs.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
               "pydoc_data", "config-3.11-x86_64-linux-gnu", "site-packages", "dist-packages"}


def libraries(paths):
    """Every shared library the ELF files in `paths` load, with the loader: (the path they
    are loaded by, the file it resolves to)."""
    found = set()
    for path in paths:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            for part in line.split():
                if part.startswith("/"):
                    found.add((part, os.path.realpath(part)))
    return sorted(found)


def in_usr(path):
    """`path` inside the image, where /lib and /lib64 are /usr's."""
    rel = path.lstrip("/")
    return rel if rel.startswith("usr/") else "usr/" + rel


def add_tree(tar, src, arcname, skip=()):
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        rel = os.path.relpath(dirpath, src)
        base = arcname if rel == "." else os.path.join(arcname, rel)
        tar.add(dirpath, arcname=base, recursive=False, filter=normalize)
        for name in sorted(filenames):
            tar.add(os.path.join(dirpath, name), arcname=os.path.join(base, name),
                    recursive=False, filter=normalize)


def normalize(info):
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def add_bytes(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(normalize(info), io.BytesIO(data))


def add_symlink(tar, name, target):
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    tar.addfile(normalize(info))


def runtime_layer(venv):
    python = os.path.realpath("/usr/bin/python3")
    stdlib = "/usr/lib/python3.11"
    site = os.path.join(venv, "lib/python3.11/site-packages")
    elves = [python] + [os.path.join(d, f)
                        for d, _, fs in os.walk(os.path.join(stdlib, "lib-dynload")) for f in fs
                        if f.endswith(".so")]
    elves += [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(site, "grpc"))
              for f in fs if f.endswith(".so")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        # Debian is merged-/usr: /lib and /lib64 point into /usr.
        for d in ["usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "app"]:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(normalize(info))
        add_symlink(tar, "lib", "usr/lib")
        add_symlink(tar, "lib64", "usr/lib64")
        add_symlink(tar, "bin", "usr/bin")
        tar.add(python, arcname="usr/bin/" + os.path.basename(python), filter=normalize)
        add_symlink(tar, "usr/bin/python3", os.path.basename(python))
        seen_dirs = {"usr", "usr/lib", "usr/lib64"}
        added = set()

        def parents(rel):
            parts = os.path.dirname(rel).split("/")
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in seen_dirs:
                    info = tarfile.TarInfo(d)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(normalize(info))
                    seen_dirs.add(d)

        for loaded, real in libraries(elves):
            real_rel, loaded_rel = in_usr(real), in_usr(loaded)
            if real_rel not in added:
                parents(real_rel)
                tar.add(real, arcname=real_rel, filter=normalize)
                added.add(real_rel)
            # The name it is loaded by (a soname, the loader's path) points at the file.
            if loaded_rel != real_rel and loaded_rel not in added:
                parents(loaded_rel)
                add_symlink(tar, loaded_rel, os.path.relpath(real_rel, os.path.dirname(loaded_rel)))
                added.add(loaded_rel)
        add_tree(tar, stdlib, "usr/lib/python3.11", skip=STDLIB_SKIP)
        for package in ["grpc", "google", "typing_extensions.py"]:
            src = os.path.join(site, package)
            if os.path.isdir(src):
                add_tree(tar, src, "app/site/" + package, skip={"__pycache__"})
            elif os.path.exists(src):
                tar.add(src, arcname="app/site/" + package, filter=normalize)
        add_bytes(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/false\n"
                  b"harness:x:1000:1000::/tmp:/bin/false\n")
        add_bytes(tar, "etc/group", b"root:x:0:\nharness:x:1000:\n")
    return buf.getvalue()


def harness_layer(venv):
    stubs = tempfile.mkdtemp()
    try:
        subprocess.run([os.path.join(venv, "bin/python"), "-m", "grpc_tools.protoc",
                        "-I", os.path.join(ROOT, "proto/api"),
                        "--python_out=" + stubs, "--grpc_python_out=" + stubs,
                        "common.proto", "harness.proto"], check=True)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for d in ["app/stubs"]:
                info = tarfile.TarInfo(d)
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(normalize(info))
            for name in sorted(os.listdir(stubs)):
                if name.endswith(".py"):
                    tar.add(os.path.join(stubs, name), arcname="app/stubs/" + name,
                            filter=normalize)
            tar.add(os.path.join(HERE, "harness.py"), arcname="app/harness.py",
                    filter=normalize)
        return buf.getvalue()
    finally:
        shutil.rmtree(stubs)


def blob(out, data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(out, "blobs/sha256", digest), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(os.path.join(args.out, "blobs/sha256"), exist_ok=True)
    with open(os.path.join(args.out, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion":"1.0.0"}')
    layers = [gzip.compress(runtime_layer(args.venv), compresslevel=1, mtime=0),
              harness_layer(args.venv)]
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {
            "Entrypoint": ["python3", "/app/harness.py"],
            "Cmd": ["--listen", "unix:{socket}"],
            "Env": ["PATH=/usr/bin:/bin", "PYTHONPATH=/app/site:/app/stubs",
                    "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"],
            "WorkingDir": "/app",
            "User": "harness",
        },
        "rootfs": {"type": "layers", "diff_ids": []},
    }
    config_desc = blob(args.out, json.dumps(config).encode())
    layer_descs = [dict(blob(args.out, data), mediaType=media) for data, media in
                   zip(layers, ["application/vnd.oci.image.layer.v1.tar+gzip",
                                "application/vnd.oci.image.layer.v1.tar"])]
    manifest = {"schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": dict(config_desc,
                               mediaType="application/vnd.oci.image.config.v1+json"),
                "layers": layer_descs}
    manifest_desc = blob(args.out, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [dict(
        manifest_desc, mediaType="application/vnd.oci.image.manifest.v1+json",
        platform={"architecture": "amd64", "os": "linux"})]}
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(index, f)
    print(f"{args.out}: {sum(len(l) for l in layers) >> 20} MiB of layers", file=sys.stderr)


if __name__ == "__main__":
    main()
