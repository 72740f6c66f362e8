"""vllm_ling.seams and `python -m ling_tools.seams`: the installed vLLM has every seam; a seam of each kind,
removed or renamed in a small copy of its source, is named; the command's report and exit codes."""
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from ling_tools import seams as cli
from vllm_ling import seams

INSTALLED = seams.vllm_root()
needs_vllm = pytest.mark.skipif(INSTALLED is None, reason="no vLLM installed")


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory) -> Path:
    """The installed vLLM's files that the table made `missing()` read, copied (~70 files, not 3,600)."""
    if INSTALLED is None:
        pytest.skip("no vLLM installed")
    read: set[Path] = set()
    real = seams._tree

    def recording(root, dotted):
        path, tree = real(root, dotted)
        if path is not None:
            read.add(path)
        return path, tree

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(seams, "_tree", recording)
        seams.missing(INSTALLED)
        seams.missing(INSTALLED, optional=True)
    out = tmp_path_factory.mktemp("small") / "src"
    for path in read:
        target = out / path.relative_to(INSTALLED)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return out


@pytest.fixture
def tree(small_tree, tmp_path) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(small_tree, copy)
    return copy


def edit(root: Path, module: str, pattern: str, new: str) -> None:
    """Rewrite `pattern` (a regex) in a module's file; the test fails if the pattern is not there."""
    path = seams._file(root, module)
    text, n = re.subn(pattern, new, path.read_text())
    assert n, f"{pattern!r} not in {path}"
    path.write_text(text)


@needs_vllm
def test_the_installed_vllm_has_every_seam():
    assert seams.missing() == []
    assert seams.missing(optional=True) == []


def test_a_copy_of_the_files_the_table_names_has_every_seam(tree):
    assert len(list(tree.rglob("*.py"))) < 150
    assert seams.missing(tree) == [] and seams.missing(tree, optional=True) == []


@pytest.mark.parametrize("module, pattern, new, said", [
    # a top-level name: a class renamed
    ("vllm.model_executor.layers.mla", r"\bclass MLAModules\b", "class MLAParts",
     "vllm.model_executor.layers.mla: MLAModules"),
    # a class member: a static method renamed
    ("vllm.model_executor.layers.mamba.mamba_utils", r"def _orient_conv_shape\b", "def _conv_shape",
     "vllm.model_executor.layers.mamba.mamba_utils: MambaStateShapeCalculator._orient_conv_shape"),
    # a config field
    ("vllm.config.speculative", r"\buse_local_argmax_reduction: bool", "local_argmax: bool",
     "field SpeculativeConfig.use_local_argmax_reduction"),
    # a keyword parameter
    ("vllm.model_executor.layers.fused_moe.layer", r"\bswiglu_limit: float", "swiglu_clamp: float",
     "vllm.model_executor.layers.fused_moe.layer: parameter FusedMoEFactory(swiglu_limit)"),
    # a name exported through `from .x import *` (vllm.distributed)
    ("vllm.distributed.parallel_state", r"def get_tensor_model_parallel_rank\b", "def get_tp_rank",
     "vllm.distributed: get_tensor_model_parallel_rank"),
    # a name a package exports lazily through its `__getattr__` (vllm.ModelRegistry)
    ("vllm", r"\bModelRegistry\b", "ModelCatalogue", "vllm: ModelRegistry"),
])
def test_a_renamed_seam_of_each_kind_is_named(tree, module, pattern, new, said):
    edit(tree, module, pattern, new)
    lines = seams.missing(tree)
    assert any(said in line for line in lines), lines


def test_a_removed_module_is_named(tree):
    seams._file(tree, "vllm.model_executor.layers.rotary_embedding").unlink()
    assert "no module vllm.model_executor.layers.rotary_embedding" in seams.missing(tree)


def test_either_spelling_of_a_name_will_do_but_not_a_third(tree):
    """"A|B" in a seam: a name the releases spell two ways."""
    seam = seams.names("vllm.model_executor.layers.fused_moe", "FusedMoEFactory|FusedMoEMaker")
    assert seams.check(seam, tree) == []
    edit(tree, "vllm.model_executor.layers.fused_moe", r"\bFusedMoEFactory\b", "FusedMoEMaker")
    assert seams.check(seam, tree) == []
    edit(tree, "vllm.model_executor.layers.fused_moe", r"\bFusedMoEMaker\b", "MoEFactory")
    assert seams.check(seam, tree) == ["vllm.model_executor.layers.fused_moe: FusedMoEFactory or FusedMoEMaker"]


def test_a_seam_with_two_homes_needs_one_of_them(tree):
    """A module that moved between releases: either path passes, neither fails with both named."""
    seam = seams.names(("vllm.entrypoints.generate.base.protocol", "vllm.entrypoints.openai.engine.protocol"),
                       "DeltaMessage ToolCall")
    assert seams.check(seam, tree) == []
    protocol = seams._file(tree, "vllm.entrypoints.generate.base.protocol")
    text = protocol.read_text()
    protocol.unlink()
    assert seams.check(seam, tree) == ["no module vllm.entrypoints.generate.base.protocol | no module "
                                       "vllm.entrypoints.openai.engine.protocol (needs one of these)"]
    moved = tree / "vllm/entrypoints/openai/engine/protocol.py"
    moved.parent.mkdir(parents=True)
    moved.write_text(text)
    assert seams.check(seam, tree) == []


def test_a_seam_the_plugin_works_without_is_listed_apart_with_what_happens_instead(tree):
    edit(tree, seams.HUMMING_ACTIVATION, r"def get_humming_activation\b", "def humming_activation")
    assert seams.missing(tree) == []
    (line,) = seams.missing(tree, optional=True)
    assert line.startswith(f"{seams.HUMMING_ACTIVATION}: get_humming_activation (without it: Humming's")
    assert "--moe-backend marlin or triton" in line


def test_a_folder_without_vllm_is_one_line_not_a_crash(tmp_path):
    assert seams.missing(tmp_path) == [f"no vllm/ source tree under {tmp_path}"]


# --- the command -----------------------------------------------------------------------------------------------


def test_the_command_reports_a_complete_tree_and_exits_0(tree, capsys):
    (tree / "vllm" / "_version.py").write_text("__version__ = version = '9.1.0'\n")
    assert cli.main(["--source", str(tree)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"vLLM 9.1.0 (source {tree}): every seam vllm-ling needs is present")


def test_the_command_names_each_missing_seam_and_exits_1(tree, capsys):
    edit(tree, "vllm.model_executor.layers.mla", r"\bclass MLAModules\b", "class MLAParts")
    assert cli.main(["--source", str(tree), "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is False and r["release"] == "unknown"
    assert r["missing"] == ["vllm.model_executor.layers.mla: MLAModules",
                            "no class MLAModules in vllm.model_executor.layers.mla"]
    assert cli.main(["--source", str(tree)]) == 1
    assert "  missing: vllm.model_executor.layers.mla: MLAModules" in capsys.readouterr().out


def test_usage_and_a_folder_without_vllm_exit_2(tmp_path, capsys):
    assert cli.main(["--source", str(tmp_path)]) == 2
    assert "holds no vllm/ folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--latest", "--release", "0.34.0"])
    assert e.value.code == 2


def test_a_downloaded_wheel_gives_its_release_and_only_its_python_sources(tmp_path):
    """pip is replaced by a runner that drops a wheel where pip would: no network in tests."""
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "vllm-0.99.0-cp38-abi3-manylinux_2_31_x86_64.whl", "w") as z:
            z.writestr("vllm/__init__.py", "ModelRegistry = None\n")
            z.writestr("vllm/_C.abi3.so", b"\0")
            z.writestr("vllm-0.99.0.dist-info/METADATA", "Name: vllm\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    wheel = cli.fetch_wheel("0.99.0", tmp_path / "dl", run=fake_pip)
    assert cli.wheel_release(wheel) == "0.99.0" and calls[0][-1] == "vllm==0.99.0"
    assert "--no-deps" in calls[0] and "--only-binary=:all:" in calls[0] and "3.12" in calls[0]
    root = cli.unpack_sources(wheel, tmp_path / "src")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == ["vllm/__init__.py"]
    assert "no module vllm.config" in seams.missing(root)


def test_a_failed_download_is_an_error_naming_pips_last_line(tmp_path):
    def failing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Location 'x' is ignored\n"
                                                       "ERROR: No matching distribution found for vllm==9.9\n")
    with pytest.raises(cli.FetchError, match="exit 1.*No matching distribution found for vllm==9.9"):
        cli.fetch_wheel("9.9", tmp_path, run=failing)
    assert cli.pip_download_cmd("vllm", tmp_path)[-1] == "vllm"  # --latest: pip picks the newest
