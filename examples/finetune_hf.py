"""Fine-tune a saved Hugging Face model on a text file of yours, through 2 pipeline stages.

    python examples/finetune_hf.py            # about 40 s on 2 cores

It makes what a user brings, with nothing downloaded: a tiny Llama and a tokenizer learnt
from a text, saved by ``save_pretrained`` (as a checkpoint of yours is), and a text file.
Then it runs what this command does (``gpipe train`` is the same library)::

    gpipe train --model FOLDER --data notes.txt --size tiny --lr 3e-3 --steps 30 -o RUN

Each of the 2 processes builds only its half of the model and reads only its own tensors
from the folder; the text is tokenized by the folder's tokenizer, packed into samples of 64
tokens, 5 % held out for validation. Last, the run is exported as a ``save_pretrained``
folder (``gpipe export RUN``) and loaded back with ``from_pretrained``. See
docs/your-model.md for every option. Needs the hf extra (pip install 'gpipe[hf]').
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpipe.cli.export import export
from gpipe.train import resolve, run
from gpipe.train.data import stdlib_bytes


def your_model(folder: Path, text: str) -> None:
    """A byte-level BPE tokenizer learnt from ``text`` and a tiny Llama, saved in ``folder``."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    learn = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator([text], learn)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="gpipe-finetune-"))
    text = bytes(stdlib_bytes(200_000).tolist()).decode("utf-8", "replace")
    (work / "notes.txt").write_text(text)
    your_model(work / "my-llama", text)
    print(f"saved a tiny Llama and its tokenizer in {work / 'my-llama'}, text in notes.txt\n")

    config = resolve({
        "model": str(work / "my-llama"), "data": str(work / "notes.txt"), "size": "tiny",
        "lr": 3e-3, "steps": 30, "eval_every": 15, "save_every": 30, "sample_tokens": 20,
        "progress": "lines", "out": str(work / "run"),
    })  # fmt: skip
    summary = run(config)  # 2 processes, one stage each; rank 0 prints the progress

    folder = export(work / "run")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    print(f"\nexported to {folder}/ and loaded back: {type(model).__name__}, "
          f"val loss {summary['val_loss']:.3f}")  # fmt: skip


if __name__ == "__main__":  # the 2 processes import this file: only the first one runs it
    main()
