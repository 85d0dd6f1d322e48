"""Which parts of the prompt did the answer come from? RCStat attribution on the embedded model (transformers).

For every generated sentence, prints the prompt with its best spans highlighted (1st green, 2nd yellow,
3rd orange) and the scores (Eq. 10: they sum to 1 over the prompt spans).

    python examples/attribution_demo.py
    python examples/attribution_demo.py --question "Who keeps the camel?" --doc "The camel is called Tofu." \
        --doc "Its keeper is Olga." --spans chunks
    python examples/attribution_demo.py --prompt "Some text. More text." --generation "Text."   # score given text
    python examples/attribution_demo.py --no-color --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from rcstat_vllm.attribution.hf import attribute, chat_prompt, load_model
from rcstat_vllm.attribution.report import render_prompt

DEFAULT_DOCS = [
    "The lighthouse on Marrow Point was built in 1874 by a Scottish engineer. It is painted with red and "
    "white stripes.",
    "Greta Lindqvist keeps bees on the roof of the town library. Her honey won a prize at the autumn fair.",
    "The ferry to Oskaro leaves at seven every morning. The crossing takes forty minutes when the sea is calm.",
]
DEFAULT_QUESTION = "When does the ferry to Oskaro leave, and how long is the crossing?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--question", default=None, help="question asked after the documents (chat prompt)")
    parser.add_argument("--doc", action="append", default=None, help="a document (repeat); default: three")
    parser.add_argument("--prompt", default=None, help="raw prompt text instead of a chat prompt")
    parser.add_argument("--generation", default=None, help="score this text as the generation (no sampling)")
    parser.add_argument("--spans", default="sentences", choices=("sentences", "chunks", "tokens"))
    parser.add_argument("--generated-spans", default="sentences", choices=("sentences", "all"))
    parser.add_argument("--k", type=int, default=None, help="top heads (default 2%% of heads)")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-color", action="store_true")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    docs = args.doc or DEFAULT_DOCS
    chunks = None
    if args.prompt is not None:
        prompt = args.prompt
    else:
        question = args.question or DEFAULT_QUESTION
        body = "\n".join(docs)
        prompt = chat_prompt(tokenizer, f"{body}\n\nQuestion: {question}\nAnswer in one or two sentences.")
        chunks = docs if args.spans == "chunks" else None
    generated_ids = None
    if args.generation is not None:
        generated_ids = tokenizer(args.generation, add_special_tokens=False)["input_ids"]
    result = attribute(
        model,
        tokenizer,
        prompt,
        generated_ids,
        max_new_tokens=args.max_new_tokens,
        options={"k": args.k},
        spans=args.spans,
        chunks=chunks,
        generated_spans=args.generated_spans,
        top=args.top,
    )
    color = not args.no_color
    print(f"Generation: {result.generated_text.strip()}")
    print(f"Top heads (layer, head): {result.heads}  estimator: {result.estimator}\n")
    for index, generated in enumerate(result.generated):
        print("=" * 100)
        print(f"Generated span {index + 1}: {generated.span.text!r}")
        for rank, best in enumerate(generated.top):
            print(f"  {rank + 1}. {best['score']:.3f}  chars {best['start']}-{best['end']}  {best['text'][:80]!r}")
        print("-" * 100)
        print(render_prompt(result, index, color=color))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_dict(), handle, indent=1)


if __name__ == "__main__":
    main()
