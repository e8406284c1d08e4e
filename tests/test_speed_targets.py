"""scripts/speed_targets.py: one command for a CPU class's speed targets, each target kept as it finishes
(a cut-off run resumes), a summary table from the benches' own side-by-side ratios."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "speed_targets.py"


@pytest.fixture(scope="module")
def speed_targets():
    spec = importlib.util.spec_from_file_location("speed_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_a_target_runs_once_and_a_second_run_resumes_from_its_file(speed_targets, tmp_path, capsys):
    args = ["--out", str(tmp_path), "--model", "tiny", "--contexts", "96", "--batch", "0",
            "--acceptance-context", "0", "--repeat", "1", "--max-tokens", "4"]
    assert speed_targets.main(args) == 0
    kept = tmp_path / "decode-96.json"
    first = capsys.readouterr().out
    assert kept.exists() and "| decode-96 |" in first and "kernels:" in first   # the CPU and build beside
    row = first.splitlines()[-3].split("|")
    assert float(row[2]) > 0 and row[7].strip() == "True"    # a ratio measured; VeriCache identical to full
    stamp = kept.stat().st_mtime_ns
    assert speed_targets.main(args + ["--record", str(tmp_path / "r.md")]) == 0
    assert kept.stat().st_mtime_ns == stamp                       # not run again
    assert "done before" in capsys.readouterr().err
    assert "| decode-96 |" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize("bad", [["--contexts", "8K"], ["--batch", "8x"], ["--repeat", "0"], ["--contexts", "-5"]])
def test_bad_arguments_exit_2_naming_them_and_run_nothing(speed_targets, tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        speed_targets.main(["--out", str(tmp_path / "o"), *bad])
    assert exc.value.code == 2
    assert not (tmp_path / "o").exists()
    err = capsys.readouterr().err
    assert "--" in err and ("context" in err or "repeat" in err)
