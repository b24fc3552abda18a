"""Loads a kiln lm-eval task's JSONL file from this directory, wherever lm-eval runs.

The task YAMLs name it as `custom_dataset: !function kiln_data.load`; lm-eval resolves that
beside the YAML and calls it with the task's `dataset_kwargs` (here `data_file`) and its
metadata (the model arguments among them, ignored). `dataset_path: json` with `data_files`
would resolve against the working directory instead. Builds the dataset in memory: no
download, no Hugging Face datasets cache.
"""

import json
import pathlib

import datasets

HERE = pathlib.Path(__file__).resolve().parent


def load(data_file, split="test", **_metadata):
    lines = (HERE / data_file).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
