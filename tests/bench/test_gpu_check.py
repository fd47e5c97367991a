"""The GPU check's one device call (docs/gpu_check.md) cannot rot: the documented command runs here on the
stand-in box (bench/gpu/box_standin.py) to its end and killed at a random moment, returning through $OUT the
probe and every step it finished; what it returns becomes gpu.json and the README's rows; the carry
installs and imports on a CPython 3.12 (or, without one, fits the box by its tags) and fits the device
tool's limit. Also: the VPT-2x stand-in has VPT-2x's size and behaves as a recurrent policy must."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch

from bench import report
from bench.gpu import box, box_standin, carry, collect, crafter, outbox
from bench.gpu.check import install_carry
from bench.gpu.plan import BOX, STAND_IN, STEPS, documented_call
from bench.gpu.vpt_standin import TINY, VPT_2X, VPTStandIn, count_parameters

ROOT = Path(__file__).resolve().parents[2]
# MineStudio's VPTPolicy with the foundation-model-2x kwargs (bench/bench_trainer_memory.py's VPT_2X),
# built from MineStudio's code (commit f6a1c23) on the meta device: 248,495,294 parameters, 3 of them the
# value normaliser's frozen statistics (Overworld keeps those as buffers).
VPT_2X_TRAINABLE = 248_495_291
FINAL = ("ok", "timed out", "failed")


def test_the_standin_has_vpt_2x_size_and_memory() -> None:
    assert count_parameters(VPT_2X) == VPT_2X_TRAINABLE
    with torch.device("meta"):
        state = VPTStandIn(VPT_2X).initial_state(1)
    floats = sum(v.numel() * v.element_size() for k, v in state.items() if k != "valid")
    assert floats == 4 * 2 * 128 * 2048 * 4  # VPT-2x's transformer memory per env: 8.4 MB


def test_the_standin_is_a_recurrent_policy_with_episode_resets() -> None:
    """Windows with the memory carried give what one pass gives; an episode start forgets the past."""
    torch.manual_seed(0)
    policy = VPTStandIn(TINY).eval()
    B, T = 2, 12
    image = torch.randint(0, 256, (B, T, TINY.image, TINY.image, 3), dtype=torch.uint8)
    first = torch.zeros(B, T, dtype=torch.bool)
    first[:, 0] = True
    first[1, 7] = True
    with torch.no_grad():
        whole, _ = policy({"image": image}, policy.initial_state(B), first)
        state, parts = policy.initial_state(B), []
        for start in range(0, T, 4):
            out, state = policy({"image": image[:, start:start + 4]}, state, first[:, start:start + 4])
            parts.append(out.vpred)
        fresh, _ = policy({"image": image[1:, 7:]}, policy.initial_state(1), first[1:, 7:])
    torch.testing.assert_close(torch.cat(parts, 1), whole.vpred, rtol=0, atol=1e-5)
    torch.testing.assert_close(fresh.vpred, whole.vpred[1:, 7:], rtol=0, atol=1e-5)
    assert not torch.allclose(whole.vpred[1, 3:7], fresh.vpred[0, :4])  # the memory mattered before the start


# -- the call and what it carries --------------------------------------------------------------------------------
def test_the_documented_call_fits_the_device_tool() -> None:
    call = documented_call()
    assert set(call) == {"command", "carry", "timeout_s"}
    assert len(call["command"]) < 2000 and "python3 -m bench.gpu.check" in call["command"]
    assert not re.search(r"\bmake\b", call["command"])  # the box may have no make
    assert call["carry"] == [carry.CARRY_DIR] and len(call["carry"]) <= 8
    for path in call["carry"]:  # a carried path is one git ignores: it would not travel otherwise
        assert subprocess.run(["git", "check-ignore", "-q", f"{path}/"], cwd=ROOT).returncode == 0, path
    # every result in $OUT by 8.5 minutes, and the tool's limit (at most 10) after that
    assert BOX.budget <= 8.5 * 60 < call["timeout_s"] <= 600
    assert BOX.crafter_least > BOX.crafter_stop + BOX.end_margin


def test_the_wheel_set_is_pinned_as_the_project_is_and_carries_only_what_the_box_lacks() -> None:
    wheels = box.wheel_requirements()
    assert wheels and all(wheels.values())
    for name, version in wheels.items():
        assert metadata.version(name) == version, name
    pyproject = (ROOT / "pyproject.toml").read_text()
    for needed in ("omegaconf", "crafter", "gymnasium", "grpcio", "protobuf", "cryptography"):
        assert f'"{needed}=={wheels[needed]}"' in pyproject
    # the box's own packages stay the box's (its torch was installed with them), but for the two whose
    # version the committed stubs need
    assert set(wheels) & set(box.box_packages()) == {"grpcio", "protobuf"}


def test_every_runtime_dependency_is_on_the_box_or_carried() -> None:
    """A dependency added to the project reaches the GPU box, or is named as one the check never needs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {box.normalize(re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0])
              for d in [*project["dependencies"], *project["optional-dependencies"]["rollout-worker"],
                        *project["optional-dependencies"]["trainer"]]}
    missing = needed - set(box.box_packages()) - set(box.wheel_requirements()) - set(box.LEFT_BEHIND)
    assert not missing, f"add them to bench/gpu/wheels.txt (or to box.LEFT_BEHIND): {sorted(missing)}"


def test_a_wheel_fits_the_box_only_for_its_python_and_platform() -> None:
    assert carry.fits("grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert carry.fits("cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl")
    assert carry.fits("crafter-1.8.3-py3-none-any.whl")
    assert not carry.fits("grpcio-1.85.1-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert not carry.fits("grpcio-1.85.1-cp312-cp312-macosx_11_0_universal2.whl")
    assert not carry.fits("grpcio-1.85.1-cp312-cp312-manylinux_2_17_aarch64.whl")
    assert not carry.fits("cffi-2.1.1-cp312-cp312-manylinux_2_34_x86_64.whl")  # a newer glibc than promised
    assert carry.portable("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl")
    assert not carry.portable("grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.whl")


def test_what_travels_is_what_the_device_tool_copies_and_its_limit_holds(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    (checkout / ".gitignore").write_text("/ignored/\n/gpu-wheels/\n")
    for name, size in (("tracked.txt", 1000), ("untracked.txt", 2000), ("ignored/big.bin", 5000)):
        (checkout / name).parent.mkdir(exist_ok=True)
        (checkout / name).write_bytes(b"x" * size)
    subprocess.run(["git", "add", "tracked.txt", ".gitignore"], cwd=checkout, check=True)
    travelling = {p.relative_to(checkout).as_posix() for p in carry.travelling_files(checkout)}
    assert travelling == {".gitignore", "tracked.txt", "untracked.txt"}
    wheels = checkout / "gpu-wheels"
    wheels.mkdir()
    (wheels / "a.whl").write_bytes(b"x" * 300)
    assert carry.travelling_bytes(checkout, [wheels]) == 1000 + 2000 + 300 + len("/ignored/\n/gpu-wheels/\n")


def test_the_carry_refuses_a_set_over_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    (checkout / "tracked.txt").write_bytes(b"x" * 1000)
    names = {n: f"{n.replace('-', '_')}-{v}-py3-none-any.whl" for n, v in box.wheel_requirements().items()}
    monkeypatch.setattr(carry, "download", lambda req, out, py: (out / names[req.split("==")[0]]).write_bytes(b"x" * 10))
    travelling = 1000 + 10 * len(names)  # the wheels are built outside the checkout: they travel as carry
    assert len(carry.build(tmp_path / "w", checkout=checkout, limit=travelling)) == len(names)
    with pytest.raises(SystemExit, match="over what a device call carries"):
        carry.build(tmp_path / "w", checkout=checkout, limit=travelling - 1)


def test_outbox_names_are_what_the_device_tool_brings_back(tmp_path: Path) -> None:
    out = outbox.Outbox(tmp_path)
    for bad in ("a/b.json", "a b.json", "ü.json"):
        with pytest.raises(ValueError):
            out.path(bad)
    out.write("probe.json", {"a": 1})
    out.write("probe.json", {"a": 2})
    assert json.loads((tmp_path / "probe.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]


# -- the figures -----------------------------------------------------------------------------------------------
def test_crafter_figures_come_from_the_learning_curve() -> None:
    curve = [{"wall_seconds": 4.0, "env_steps": 0, "iteration": 0},
             {"wall_seconds": 10.0, "env_steps": 500, "iteration": 1, "trainer/iteration_seconds": 2.0,
              "trainer/update_seconds": 1.5},
             {"wall_seconds": 12.0, "env_steps": 900, "iteration": 1, "trainer/iteration_seconds": 2.0},
             {"wall_seconds": 20.0, "env_steps": 2500, "iteration": 3, "episodes": 4, "trainer/iteration_seconds": 1.0,
              "trainer/update_seconds": 0.5, "crafter/crafter_score": 2.5}]
    figures = crafter.curve_figures(curve)
    assert figures["env_steps"] == 2500 and figures["startup_seconds"] == 10.0
    assert figures["env_steps_per_second"] == pytest.approx((2500 - 500) / 10.0)
    assert figures["learner_seconds_per_iteration"] == 1.5  # median over iterations 1 and 3, not over points
    assert figures["learner_parts_seconds"] == {"iteration": 2.0, "update": 1.0}
    assert figures["score"] == 2.5 and figures["episodes"] == 4
    assert crafter.curve_figures(curve[:1])["env_steps"] == 0


def test_the_full_benchmark_calls_follow_from_the_measured_rate() -> None:
    probe = {"stand_in": False, "budget_seconds": 510.0, "elapsed": 30.0}
    full = collect.full_benchmark_calls(probe, {"env_steps_per_second": 1000.0, "startup_seconds": 25.0})
    # 510 - 5 (end margin) - 40 (stop) - 30 (probe) - 25 (start) = 410 s of Crafter a call
    assert full["crafter_seconds_per_call"] == 410.0 and full["env_steps_per_call"] == 410_000
    assert full["calls"] == 8  # 3,000,000 / 410,000 = 7.3
    assert collect.full_benchmark_calls(probe, {"env_steps_per_second": None})["calls"] is None


def fake_call_files(directory: Path, stand_in: bool) -> Path:
    """$OUT of a call cut during vpt2x."""
    directory.mkdir()
    host = {"cpu": "x", "cpus": 16, "gpu": "NVIDIA H100 80GB HBM3", "driver": "580", "code_digest": "0"}
    on = {"device": "NVIDIA H100 80GB HBM3", "driver": "580", "torch": "2.11.0+cu130"}
    (directory / "probe.json").write_text(json.dumps({"status": "ok", "stand_in": stand_in, "host": host, "on": on,
                                                      "command": "python3 -m bench.gpu.check --out /o",
                                                      "started_unix": 1.8e9, "elapsed": 20.0}))
    rows = {"cuda": {"env_steps_per_second": 900.0}, "cpu": {"env_steps_per_second": 300.0}}
    (directory / "rollout.json").write_text(json.dumps({"status": "ok", "on": on, "num_envs": 16, "batch_size": 8,
                                                        "rows": rows, "cuda_over_cpu": 3.0}))
    (directory / "vpt2x.json").write_text(json.dumps({"status": "running", "on": on, "warmup": {"seconds": 9.0}}))
    return directory


def test_collect_keeps_what_the_call_did_not_finish(tmp_path: Path) -> None:
    files = fake_call_files(tmp_path / "out", stand_in=False)
    assert collect.main([str(files), "--results", str(tmp_path / "results")]) == 0
    result = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert result["rollout"]["status"] == "ok" and result["vpt2x"]["status"] == "cut off"
    assert result["vpt2x"]["warmup"] == {"seconds": 9.0}
    assert result["amp_fp16"]["status"] == "not reached" and result["crafter"]["status"] == "not reached"
    assert re.fullmatch(r"[0-9a-f]{40}", result["commit"]) and result["tree_modified"]  # digest "0" is no commit's
    assert result["machine"]["gpu"] == "NVIDIA H100 80GB HBM3" and result["command"].startswith("python")
    rows = report.headline_rows("gpu", result)
    assert "900 vs 300 (3.0×)" in rows[0] and "| gpu | vpt2x | cut off |" in rows[1]
    readme = "\n".join(report.readme_rows({"gpu": result}))
    assert "NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)" in readme and "VPT-2x cut off" in readme


def test_collect_never_writes_the_stand_ins_files_into_bench_results(tmp_path: Path) -> None:
    files = fake_call_files(tmp_path / "out", stand_in=True)
    before = (collect.RESULTS / "gpu.json").read_bytes() if (collect.RESULTS / "gpu.json").exists() else None
    assert collect.main([str(files)]) == 2
    after = (collect.RESULTS / "gpu.json").read_bytes() if (collect.RESULTS / "gpu.json").exists() else None
    assert after == before


def test_the_make_targets_rehearse_the_call_and_build_the_carry() -> None:
    def dry(target: str) -> str:
        # --no-print-directory: under a parent make (CI's `make test`) the last line would be "Leaving directory"
        return subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.splitlines()[-1]

    assert dry("gpu-check").endswith("-m bench.gpu.box_standin")
    assert dry("gpu-wheels").endswith("-m bench.gpu.carry --out gpu-wheels")


# -- the call on the stand-in box ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stand_in_box(tmp_path_factory: pytest.TempPathFactory) -> box_standin.StandInBox:
    return box_standin.prepare(tmp_path_factory.mktemp("stand-in"))


def check_out_files(out: Path) -> dict[str, dict]:
    """$OUT as the device tool brings it back: at most 8 plain files, all there; each JSON complete."""
    files = sorted(out.iterdir())
    assert len(files) <= outbox.MAX_FILES and all(f.is_file() and outbox.NAME.fullmatch(f.name) for f in files)
    assert all(f.stat().st_size <= outbox.MAX_FILE_BYTES for f in files)
    return {f.stem: json.loads(f.read_text()) for f in files if f.suffix == ".json"}


def assert_probe(probe: dict) -> None:
    assert probe["status"] == "ok" and probe["stand_in"], probe.get("problems")
    assert probe["host"]["tools"]["make"] is None  # the stand-in box has none, and the call needs none
    assert probe["on"]["torch"] == torch.__version__
    imports = probe["imports"]
    assert all(row["ok"] and row["from_carry"] for row in imports.values() if row["group"] == "carried")
    assert not imports["ray"]["ok"]  # not on the box: the pipeline runs without it


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_call_returns_every_result_through_out(stand_in_box: box_standin.StandInBox,
                                                              tmp_path: Path) -> None:
    run = box_standin.run_call(stand_in_box, tmp_path / "out", STAND_IN.budget)
    assert run.killed_at is None and run.exit_code == 0, run.output[-6000:]
    found = check_out_files(tmp_path / "out")
    assert set(found) == {"probe", *STEPS}
    assert_probe(found["probe"])
    for name in STEPS:
        step = found[name]
        assert step["status"] == "ok" and step["log_tail"] and step["on"]["torch"] == torch.__version__, name
    rollout, vpt, amp, craft = (found[name] for name in STEPS)
    assert all(row["env_steps"] > 0 for row in rollout["rows"].values())
    assert vpt["parameters_vpt_2x"] == VPT_2X_TRAINABLE and vpt["losses_finite"]
    assert vpt["chains_measured"] == vpt["settings"]["chains"] and vpt["iterations"][-1]["optimizer_steps"] >= 1
    assert vpt["settings"]["autocast"] == "torch.bfloat16" and vpt["settings"]["reference_policy"]
    assert amp["forward_dtypes"] == ["torch.float16"] and amp["scaler_restored"] and amp["weights_changed"]
    # Crafter ran until the call's planned end, then stopped as Ctrl-C stops it
    assert craft["stopped_by"] == "stopped at the call's planned end" and craft["summary"]["status"] == "interrupted"
    assert craft["env_steps"] > 0 and craft["env_steps_per_second"] > 0 and craft["learner_seconds_per_iteration"] > 0
    assert (craft["score"] is not None) == bool(craft["episodes"])
    log = (tmp_path / "out" / "check.log").read_text()
    assert all(f"== {name}" in log for name in STEPS) and "probe: ok" in log

    assert collect.main([str(tmp_path / "out"), "--results", str(tmp_path / "results")]) == 0
    result = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert result["stand_in"] and result["crafter"]["full_benchmark"]["calls"] >= 1
    assert result["crafter"]["env_steps"] == craft["env_steps"] and result["call"] == documented_call()
    readme = report.readme_rows({"gpu": result})
    assert len(readme) == 4 and f"{craft['env_steps']:,} env steps" in readme[-1]


@pytest.mark.slow
def test_a_call_killed_at_a_random_moment_returns_what_it_finished(stand_in_box: box_standin.StandInBox,
                                                                  tmp_path: Path) -> None:
    seed = int(os.environ.get("GPU_CHECK_KILL_SEED") or random.randrange(2**32))
    kill_after = random.Random(seed).uniform(0.0, STAND_IN.budget - 90.0)  # Crafter stops 28 s before the end
    print(f"killed {kill_after:.1f}s after the probe (GPU_CHECK_KILL_SEED={seed})")
    run = box_standin.run_call(stand_in_box, tmp_path / "out", STAND_IN.budget, kill_after_probe=kill_after)
    assert run.killed_at is not None, run.output[-6000:]
    found = check_out_files(tmp_path / "out")
    assert_probe(found["probe"])
    statuses = [found[name]["status"] if name in found else None for name in STEPS]
    ended = [s for s in statuses if s in FINAL]
    # the steps in order: those that ended, then at most the one cut, then none
    assert statuses == [*ended, *["running"][:statuses.count("running")], *[None] * statuses.count(None)], statuses
    assert statuses.count("running") <= 1
    for name in STEPS[:len(ended)]:  # each with its log tail, and an ok one with its figures' torch
        assert found[name]["log_tail"] and found[name]["status"] != "failed", (name, found[name]["log_tail"])
        assert found[name]["status"] != "ok" or found[name]["on"]["torch"] == torch.__version__, name
    log = (tmp_path / "out" / "check.log").read_text()
    for name, status in zip(STEPS, statuses, strict=True):
        assert (f"== {name}" in log) == (status is not None), name

    assert collect.main([str(tmp_path / "out"), "--results", str(tmp_path / "results")]) == 0
    result = json.loads((tmp_path / "results" / "gpu.json").read_text())
    expected = {"running": "cut off", None: "not reached"}
    assert [result[name]["status"] for name in STEPS] == [expected.get(s, s) for s in statuses]
    assert len(report.readme_rows({"gpu": result})) >= 3


# -- the carry on the box's Python -----------------------------------------------------------------------------
TORCH_ONLY = "No module named 'torch'"


@pytest.mark.slow
def test_the_box_carry_installs_and_imports_on_cpython_312(tmp_path: Path) -> None:
    wheels = carry.build(tmp_path / carry.CARRY_DIR)  # the box's: CPython 3.12, manylinux x86_64
    assert all(carry.fits(w.name) for w in wheels)
    python = carry.box_python_here()
    if python is None:  # no 3.12 on this machine: the tags above are all the proof there is
        assert all(carry.portable(w.name) or "-cp312-cp312-" in w.name for w in wheels)
        return
    # the box's own packages that the probe imports (numpy at the box's version), here from PyPI; not torch
    box_site, carried = tmp_path / "box-site", tmp_path / "site"
    known = box.box_packages()
    wanted = [f"{n}=={known.get(n) or metadata.version(n)}" for n in ("numpy", "safetensors", "prometheus-client",
                                                                      "pillow", "imageio", "pyyaml", "cloudpickle",
                                                                      "typing-extensions", "urllib3")]
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:",
                    "--target", str(box_site), *wanted], check=True, capture_output=True)
    install = install_carry(tmp_path / carry.CARRY_DIR, carried, python)
    assert install["exit_code"] == 0, install
    script = f"""
import json, sys
from pathlib import Path
from bench.gpu.probe import import_report
for top in ("services", "bench"):  # every file of the project compiles
    for path in Path({str(ROOT)!r}, top).rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
from overworld.envs.crafter_task import make_env
env = make_env(0)
env.reset()
steps = sum(1 for _ in range(100) if env.step(env.action_space.sample())[0].shape == (64, 64, 3))
print(json.dumps({{"version": sys.version_info[:2], "steps": steps, "imports": import_report(Path({str(carried)!r}))}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (carried, box_site, ROOT / "services", ROOT))),
           "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["version"] == [3, 12] and found["steps"] == 100
    imports = found["imports"]
    assert all(row["ok"] and row["from_carry"] for row in imports.values() if row["group"] == "carried"), imports
    # everything else imports, but what needs torch (the box has it)
    failed = {name: row["error"] for name, row in imports.items() if not row["ok"] and row["group"] != "optional"}
    assert failed.pop("torch") == f"ModuleNotFoundError: {TORCH_ONLY}"
    assert all(TORCH_ONLY in error for error in failed.values()), failed
    assert {"overworld.core.security.tls", "overworld.launch.run", "overworld.envs.crafter_task"}.isdisjoint(failed)
