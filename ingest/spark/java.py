"""Whether a usable Java is there, without importing Spark: `config check` and the start's preflight ask
it, and importing pyspark took longer than the check itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

MIN_JAVA = 17

_JAVA_HELP = (
    "install one (Debian/Ubuntu: `apt-get install openjdk-17-jre-headless`) "
    "or point JAVA_HOME at a JDK/JRE >= 17"
)


def java_problem() -> str | None:
    """None when a Java >= 17 is usable, else what is missing and how to get it.

    Looks where Spark's launcher does: JAVA_HOME first, then PATH.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not java.is_file():
            return f"JAVA_HOME is {java_home!r} but {java} does not exist: {_JAVA_HELP}"
        where = f"{java} (from JAVA_HOME)"
    else:
        found = shutil.which("java")
        if found is None:
            return (
                f"Spark needs Java {MIN_JAVA} or newer and none was found "
                f"(JAVA_HOME is unset and there is no java on PATH): {_JAVA_HELP}"
            )
        java = Path(found)
        where = f"{java} (from PATH)"
    try:
        # `java -version` prints to stderr; the path is a file we found, not user input
        result = subprocess.run(  # noqa: S603
            [str(java), "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {where}: {exc}; {_JAVA_HELP}"
    major = _java_major(result.stderr + result.stdout)
    if major is None:
        said = result.stderr.strip()
        return f"cannot tell the version of {where} (`java -version` said {said!r}); {_JAVA_HELP}"
    if major < MIN_JAVA:
        return f"Spark needs Java {MIN_JAVA} or newer, but {where} is Java {major}: {_JAVA_HELP}"
    return None


def _java_major(version_output: str) -> int | None:
    # 'openjdk version "17.0.15" ...', 'java version "1.8.0_292"' (old scheme: 1.x means x), 'version "21"'
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        major = int(match.group(2))
    return major
