"""The check every bad-input test shares: in-process `mpt`, exit code 2, one line, no traceback."""

from mp_toolkit.cli import main


def assert_one_line_exit_2(capsys, argv, mentions: str | None = None) -> str:
    """Run ``mpt argv`` in this process (every check runs before any rank starts); return the line."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    if mentions is not None:
        assert mentions in lines[0], lines[0]
    return lines[0]
