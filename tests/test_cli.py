"""The command line: flags typed from EngineArgs, booleans both ways, bad values one error line and exit 2
before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from furcate.cli import _checked, build_parser, main


def parse(*argv: str):
    return build_parser().parse_args(["generate", "hello", *argv])


def test_engine_flags_arrive_typed_and_booleans_go_both_ways():
    engine_args, params = _checked(parse("--context-length", "2048", "--no-disable-overlap-schedule",
                                         "--mem-fraction-static", "0.3", "--disable-radix-cache", "--top-p", "0.9",
                                         "--stop", "a", "--stop", "b", "--choices", "x", "y"))
    assert engine_args.context_length == 2048
    assert engine_args.disable_overlap_schedule is False and engine_args.disable_radix_cache is True
    assert engine_args.mem_fraction_static == 0.3
    assert params["top_p"] == 0.9 and params["stop"] == ["a", "b"] and params["choices"] == ["x", "y"]


def test_serve_flags_arrive_typed():
    from furcate.runtime.config import EngineArgs, ServerArgs, from_cli_args

    args = build_parser().parse_args(["serve", "--model-path", "m", "--port", "0", "--api-key", "k",
                                      "--context-length", "2048", "--no-disable-overlap-schedule",
                                      "--max-queued-requests", "5", "--graceful-shutdown-timeout", "2.5"])
    engine_args, server = EngineArgs.from_cli_args(args), from_cli_args(ServerArgs, args)
    assert engine_args.model_path == "m" and engine_args.context_length == 2048
    assert engine_args.disable_overlap_schedule is False and engine_args.max_queued_requests == 5
    assert server.host == "127.0.0.1" and server.port == 0 and server.api_key == "k"
    assert server.graceful_shutdown_timeout == 2.5


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "70000"], "port"),
    (["serve", "--api-key", ""], "api_key"),
    (["serve", "--max-queued-requests", "-1"], "max_queued_requests"),
    (["serve", "--max-pending-requests", "0"], "max_pending_requests"),
    (["serve", "--dp-size", "0"], "dp_size"),
    (["serve", "--dp-size", "100000"], "dp_size"),
    (["serve", "--router-policy", "fastest"], "router-policy"),
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--context-length", "abc"], "invalid int value"),
    (["generate", "hi", "--schedule-policy", "fastest"], "invalid choice"),
    (["generate", "hi", "--max-new-tokens", "-3"], "max_new_tokens"),
    (["generate", "hi", "--top-p", "nan"], "top_p"),
    (["generate", "hi", "--json-schema", "{bad"], "not valid JSON"),
    (["generate", "hi", "--regex", "x", "--choices", "a"], "at most one"),
    (["generate", "hi", "--max-total-tokens", "3"], "max_total_tokens"),
    (["prepare", "--model-path", "/no/such/model"], "not a directory"),
    (["prepare", "--torch-compile-max-bs", "0"], "torch_compile_max_bs"),
    (["prepare", "--remeasure", "--quantization", "fast"], "invalid choice"),
    (["prepare", "--remeasure=yes"], "ignored explicit argument"),
])
def test_bad_values_exit_2_with_one_error_line_before_booting(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0]


def test_version():
    out = subprocess.run([sys.executable, "-m", "furcate.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("furcate ")


def test_prepare_with_a_bad_model_is_one_error_and_forgets_no_kernel_choice(private_cache, tmp_path, capsys):
    kept = tmp_path / "kernel_choice" / "0123.json"
    kept.parent.mkdir()
    kept.write_text('{"value": 8, "busy_cores": 0.0, "provisional": false}')
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.gguf").write_bytes(b"not a gguf")
    for model in ("empty", "weights.gguf", "kernel_choice/0123.json"):
        with pytest.raises(SystemExit) as exited:
            main(["prepare", "--remeasure", "--model-path", str(tmp_path / model)])
        assert exited.value.code == 2
        assert len([line for line in capsys.readouterr().err.splitlines() if "error:" in line]) == 1
    assert kept.exists()
