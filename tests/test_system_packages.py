"""`make test` sets up a fresh machine (tests/system-packages.sh): with every listed Debian package
installed it says nothing and goes on; as a user other than root, missing packages stop it with the one
command that installs them. (As root it installs them: checked by hand in the services image, whose
Debian lacked the listed package; an automated run would install packages on the test machine.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "system-packages.sh"


def run(packages: str, as_nobody: bool = False) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:  # readable by nobody, unlike pytest's tmp_path
        here = Path(scratch)
        here.chmod(0o755)
        (here / "packages.txt").write_text(packages)
        script = here / SCRIPT.name
        shutil.copy(SCRIPT, script)
        argv = ["bash", str(script)]
        if as_nobody:
            argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
        return subprocess.run(argv, env={**os.environ, "DEBIAN_PACKAGES": str(here / "packages.txt")},
                              capture_output=True, text=True, timeout=60, cwd="/")


pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian machine")


def test_installed_packages_need_nothing() -> None:
    done = run("# the shell itself\nbash\ncoreutils  # and its tools\n", as_nobody=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_user_other_than_root_gets_the_command_that_installs_what_is_missing() -> None:
    done = run("bash\noverworld-no-such-package-a\n\noverworld-no-such-package-b # why\n", as_nobody=True)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "the tests need Debian packages this machine lacks; install them as root: apt-get install -y "
        "--no-install-recommends overworld-no-such-package-a overworld-no-such-package-b"]


def test_the_packages_the_tests_need_are_listed_once() -> None:
    names = [line.split("#")[0].strip() for line in (SCRIPT.parent / "debian-packages.txt").read_text().splitlines()]
    names = [n for n in names if n]
    assert len(names) == len(set(names)) and {"redis-server", "prometheus", "nftables", "buildah"} <= set(names)
