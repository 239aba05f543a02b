"""The main job (python -m foscar): options, one-line errors, exit status, the per-role loop report."""

import re

import pytest

from foscar.__main__ import build_parser, main


def test_help_names_the_command_and_every_option():
    parser = build_parser()
    assert parser.format_help().startswith("usage: python -m foscar")
    options = [a for a in parser._actions if a.option_strings]
    assert {"--head-dim", "--arch", "--k-group", "--v-group"} <= {o for a in options for o in a.option_strings}
    assert all(a.help for a in options)


@pytest.mark.parametrize("argv, message", [
    (["--group", "96"], "group must be one of"),
    (["--head-dim", "100"], "head_dim must be one of"),
    (["--page-size", "100"], "page_size"),
    (["--arch", "sm_80"], "invalid choice"),
])
def test_bad_option_is_one_line_not_a_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_a_kernel_that_does_not_build_fails_the_job(monkeypatch, capsys):
    import foscar.decode

    def broken(*args, **kwargs):
        raise RuntimeError("stand-in for a kernel that does not build")

    monkeypatch.setattr(foscar.decode, "compile_decode", broken)
    assert main(["--arch", "sm_90a", "--head-dim", "64", "--group", "64"]) == 1
    out = capsys.readouterr().out
    assert "decode (hopper)    not built: RuntimeError" in out and "1 of 4 kernels did not build" in out


@pytest.mark.sass
@pytest.mark.slow
def test_blackwell_report_finds_the_mma_loop(capsys):
    """The Blackwell kernel's largest loop is the softmax warpgroup's: the report must show the MMA
    warp's loop (with its tcgen05 MMAs) as the main loop, and one line per role's loop."""
    assert main(["--arch", "sm_100a"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "decode (blackwell)" in line)
    assert int(re.search(r"\((\d+) MMA", line).group(1)) > 0
    roles = re.findall(r"(\w+) loop @0x[0-9a-f]+: \d+ instr, (\d+) MMA", out)
    assert ("mma" in {r for r, _ in roles}) and all((r == "mma") == (int(n) > 0) for r, n in roles)
    assert "softmax" in {r for r, _ in roles} and "load" in {r for r, _ in roles}


@pytest.mark.slow
def test_k_and_v_bits_chosen_apart(capsys):
    """--k-bits / --v-bits compose a mixed-width variant (K4V2) and report its kernels."""
    assert main(["--arch", "sm_90a", "--k-bits", "4", "--v-bits", "2"]) == 0
    out = capsys.readouterr().out
    assert "k4v2-kc128-vt128-d128-gqa4-bfloat16" in out and "decode (hopper)" in out and "not built" not in out



@pytest.mark.parametrize("head_dim, group", [(64, 64), (128, 128), (256, 128)])
def test_groups_default_to_128_or_a_smaller_head_dim(head_dim, group, monkeypatch):
    """``--head-dim 64`` alone builds a variant: the default group follows a head_dim below 128."""
    import foscar.__main__ as job

    built = []
    monkeypatch.setattr(job, "compile_report", lambda scheme, page_size, archs: built.append(scheme) or 0)
    assert main(["--arch", "sm_100a", "--head-dim", str(head_dim)]) == 0  # sm_100a: no GPU run, on any machine
    assert (built[0].head_dim, built[0].k.group, built[0].v.group) == (head_dim, group, group)
