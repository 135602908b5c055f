"""Command line: `furcate prepare` gets a model ready ahead of time (converted, kernel choices measured, compiled
decode graphs built); `furcate generate` runs a prompt; `furcate serve` runs the HTTP server (native and OpenAI
APIs).

Every check that needs no model runs before the engine boots, and a bad value is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .version import __version__


def build_parser() -> argparse.ArgumentParser:
    from .runtime.config import EngineArgs, ServerArgs, add_dataclass_args
    from .runtime.sampling.params import declared_default

    parser = argparse.ArgumentParser(prog="furcate", description="Structured LLM programs and their runtime.")
    parser.add_argument("--version", action="version", version=f"furcate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare", help="get a model ready to serve with these engine options, and wait: convert it (the default "
        "model, or a GGUF file), measure its kernel choices, build its compiled decode graphs")
    prepare.add_argument("--remeasure", action="store_true",
                         help="forget every kept kernel choice (every model's) and measure this one's again")
    EngineArgs.add_cli_args(prepare.add_argument_group("engine (graphs are built for the options given here)"))
    prepare.set_defaults(log_level="info")  # the progress: each kernel choice, each graph as it compiles
    generate = commands.add_parser("generate", help="generate from a prompt on a local engine")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=declared_default("max_new_tokens"))
    sampling.add_argument("--temperature", type=float, default=declared_default("temperature"))
    sampling.add_argument("--top-p", type=float, default=declared_default("top_p"))
    sampling.add_argument("--top-k", type=int, default=declared_default("top_k"))
    sampling.add_argument("--n", type=int, default=declared_default("n"),
                          help="samples of the prompt (printed one after another)")
    sampling.add_argument("--stop", action="append", default=None, help="a stop string (repeat for more)")
    sampling.add_argument("--json-schema", help="constrain the output to this JSON schema (JSON text)")
    sampling.add_argument("--regex", help="constrain the output to this regular expression")
    sampling.add_argument("--choices", nargs="+", help="the output is exactly one of these strings")
    EngineArgs.add_cli_args(generate.add_argument_group("engine"))
    serve = commands.add_parser("serve", help="serve the model over HTTP (SGLang's native API and OpenAI's)")
    add_dataclass_args(ServerArgs, serve.add_argument_group("server"))
    EngineArgs.add_cli_args(serve.add_argument_group("engine"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return _prepare(parser, args)
    if args.command == "serve":
        return _serve(parser, args)
    try:
        engine_args, params = _checked(args)
    except ValueError as error:
        parser.error(str(error))  # one line, exit code 2, before any model loads
    return _generate(args, engine_args, params)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .runtime.config import EngineArgs, ServerArgs, from_cli_args
    from .runtime.server.serve import serve

    try:
        engine_args, server_args = EngineArgs.from_cli_args(args), from_cli_args(ServerArgs, args)
    except ValueError as error:
        parser.error(str(error))
    return serve(engine_args, server_args)


def _prepare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Start an engine with these options that compiles its decode graphs at start-up (the key a later engine
    with the same options looks up), report what it chose and built, and stop it."""
    import dataclasses

    from .runtime.config import EngineArgs
    from .runtime.model.weights.checkpoint import load_config, resolve_model_path

    try:  # a bad option or model fails here, before any stored choice is forgotten
        engine_args = EngineArgs.from_cli_args(args)
        load_config(resolve_model_path(engine_args.model_path))
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if engine_args.enable_torch_compile is None:
        engine_args = dataclasses.replace(engine_args, enable_torch_compile=True)
    if args.remeasure:
        from .runtime.model.kernel_choice import forget_choices

        print(f"forgot {forget_choices()} kept kernel choice(s): this model's are measured again", flush=True)
    return _prepared(parser, engine_args)


def _prepared(parser: argparse.ArgumentParser, engine_args) -> int:
    from .runtime.engine.engine import Engine

    try:
        engine = Engine(**vars(engine_args))
    except (ValueError, OSError) as error:  # e.g. a model without a tokenizer: before any process starts
        parser.error(str(error))
    with engine:
        graphs = engine.get_stats()["decode_graphs"]
        print(f"model: {engine.model_path}")
        print(f"quantized_max_rows: {engine.info.quantized_max_rows}")
        print(f"decode graphs: {graphs}")
    if engine_args.enable_torch_compile and graphs != "compiled":
        print("furcate prepare: the decode graphs were not built: see the warnings above", file=sys.stderr)
        return 1
    return 0


def _checked(args: argparse.Namespace) -> tuple:
    from .runtime.config import EngineArgs
    from .runtime.sampling.params import SamplingParams

    if not args.prompt:
        raise ValueError("the prompt is empty")
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "n": args.n, "stop": args.stop, "regex": args.regex, "choices": args.choices}
    if args.json_schema is not None:
        try:
            params["json_schema"] = json.loads(args.json_schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"--json-schema is not valid JSON: {error}") from None
    params = {k: v for k, v in params.items() if v is not None}
    SamplingParams.from_dict(params)
    return EngineArgs.from_cli_args(args), params


def _generate(args: argparse.Namespace, engine_args, params: dict) -> int:
    from .runtime.engine.engine import Engine

    with Engine(**vars(engine_args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                          add_generation_prompt=True)
        try:
            if params.get("n", 1) > 1:
                for result in engine.generate(prompt, params):
                    print(result["text"])
                return 0
            printed = 0
            for chunk in engine.generate(prompt, params, stream=True):
                sys.stdout.write(chunk["text"][printed:])
                sys.stdout.flush()
                printed = len(chunk["text"])
            sys.stdout.write("\n")
        except ValueError as error:  # a check that needs the model (e.g. the prompt is too long)
            print(f"furcate generate: error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
