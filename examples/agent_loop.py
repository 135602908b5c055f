"""An agent loop over the OpenAI API: the model calls tools, the loop runs them and sends the results back, until
the model answers in text.

It starts `furcate serve` on the default model in a child process and talks to it with the official `openai`
client. The default model's chat template knows no tools, so the first turn asks for a call (`tool_choice`
"required": the call's name and arguments are constrained to the tool's JSON schema, so they always parse and
validate); later turns let the model choose (`auto`), which needs a model whose template has a tool call format
(Qwen2.5/Qwen3, Llama 3.1+, Mistral, Hermes) or `--tool-call-parser`, so here they leave tools out.

Run: python examples/agent_loop.py
"""

from __future__ import annotations

import json

import openai

import furcate as sgl

CITIES = {"paris": "12°C, light rain", "oslo": "-3°C, snow", "lima": "19°C, overcast"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": sorted(CITIES)}}, "required": ["city"],
                   "additionalProperties": False}}}]


def get_weather(city: str) -> str:
    return CITIES[city]


def run_tool(call) -> str:
    arguments = json.loads(call.function.arguments)  # constrained to the schema: always parses, always valid
    return {"get_weather": get_weather}[call.function.name](**arguments)


def agent(client: openai.OpenAI, question: str, max_steps: int = 3) -> str:
    messages: list[dict] = [{"role": "system", "content": "Use the tools to answer."},
                            {"role": "user", "content": question}]
    for step in range(max_steps):
        # One call per turn: a 135M model asked for calls tends to go on making them.
        tools = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False} if step == 0 else {}
        reply = client.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                               **tools).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if reply.finish_reason != "tool_calls":
            return reply.message.content
        for call in reply.message.tool_calls:
            result = run_tool(call)
            print(f"  called {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "(no answer within the step limit)"


def main() -> None:
    with sgl.Runtime("default", max_total_tokens=8192) as runtime:
        client = openai.OpenAI(base_url=f"{runtime.url}/v1", api_key="unused")
        question = "What is the weather in Oslo?"
        print(question)
        print("answer:", agent(client, question))


if __name__ == "__main__":
    main()
