"""Streaming: print a program's generated text as it is produced, from plain and from async code.

`prog.run(stream=True)` returns the state at once while the program runs; `state.text_iter("story")` yields
the new text of variable `story` as it arrives. An `async def` program streams the same way with
`await prog.arun(..., stream=True)` and `async for chunk in state.text_async_iter("story")`.

Run: python examples/streaming.py
"""

from __future__ import annotations

import asyncio

import furcate as sgl


@sgl.function
def story(s, topic):
    s += sgl.user(f"Write a two-sentence story about {topic}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=48, temperature=0))


@sgl.function
async def astory(s, topic):  # an async program: it runs as a task on the caller's event loop
    s += sgl.user(f"Write a two-sentence story about {topic}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=48, temperature=0))


async def stream_async() -> None:
    state = await astory.arun(topic="a robot learning to paint", stream=True)
    chunks = 0
    async for chunk in state.text_async_iter("story"):
        print(chunk, end="", flush=True)
        chunks += 1
    await state.async_sync()  # wait without blocking the event loop; then reads return at once
    print(f"\n[{state.get_meta_info('story')['completion_tokens']} tokens in {chunks} chunks]")


def main() -> None:
    with sgl.Engine("default", max_total_tokens=8192) as engine:
        sgl.set_default_backend(engine)

        print("== run(stream=True) + text_iter ==")
        state = story.run(topic="a lighthouse keeper", stream=True)
        chunks = 0
        for chunk in state.text_iter("story"):
            print(chunk, end="", flush=True)
            chunks += 1
        print(f"\n[{state.get_meta_info('story')['completion_tokens']} tokens in {chunks} chunks]")

        print("\n== await arun(stream=True) + text_async_iter ==")
        asyncio.run(stream_async())


if __name__ == "__main__":
    main()
