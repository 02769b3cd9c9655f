"""GRPODataModule: loading, batching, seeded shuffling, and early errors that name the problem."""

import csv
import json
import pickle

import datasets
import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_grpo import data as data_module
from lit_grpo.data import GRPODataModule, PromptBatch

QUESTIONS = [{"prompt": f"What is {n} + {n}?", "answer": str(2 * n), "level": n % 3} for n in range(8)]
ANSWERS_BY_PROMPT = {row["prompt"]: row["answer"] for row in QUESTIONS}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_csv(path, rows):
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def set_up(**kwargs):
    datamodule = GRPODataModule(**kwargs)
    datamodule.setup("fit")
    return datamodule


def answers_by_prompt(batches):
    """{prompt: answer} over all batches, checking that every batch keeps prompts and columns aligned."""
    pairs = {}
    for batch in batches:
        assert all(len(values) == len(batch.prompts) for values in batch.columns.values())
        pairs.update(zip(batch.prompts, batch.columns["answer"]))
    return pairs


def test_string_prompts_in_file_order_without_shuffle(tmp_path):
    data_files = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)

    datamodule = set_up(path="json", data_files=data_files, batch_size=3, shuffle=False)
    batches = list(datamodule.train_dataloader())

    assert len(batches) == 2  # 8 rows in batches of 3: the incomplete last batch is dropped
    assert all(isinstance(batch, PromptBatch) and len(batch) == 3 for batch in batches)
    assert batches[0].prompts == [row["prompt"] for row in QUESTIONS[:3]]
    assert batches[0].columns == {
        "answer": [row["answer"] for row in QUESTIONS[:3]],
        "level": [row["level"] for row in QUESTIONS[:3]],
    }


def test_extra_columns_stay_aligned_with_shuffled_prompts(tmp_path):
    data_files = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)

    datamodule = set_up(path="json", data_files=data_files, batch_size=2, seed=5)

    assert answers_by_prompt(datamodule.train_dataloader()) == ANSWERS_BY_PROMPT


def test_chat_prompts(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}],
            "answer": "6",
        },
    ]
    data_files = write_jsonl(tmp_path / "chat.jsonl", rows)

    datamodule = set_up(path="json", data_files=data_files, batch_size=2, shuffle=False)
    (batch,) = datamodule.train_dataloader()

    assert batch.prompts == [row["prompt"] for row in rows]
    assert batch.columns == {"answer": ["4", "6"]}


@pytest.mark.parametrize("extension", ["jsonl", "csv", "parquet"])
def test_local_file_as_path(tmp_path, extension):
    path = tmp_path / f"questions.{extension}"
    if extension == "jsonl":
        write_jsonl(path, QUESTIONS)
    elif extension == "csv":
        write_csv(path, QUESTIONS)
    else:
        datasets.Dataset.from_list(QUESTIONS).to_parquet(str(path))

    datamodule = set_up(path=str(path), batch_size=4, shuffle=False)

    assert [batch.prompts for batch in datamodule.train_dataloader()] == [
        [row["prompt"] for row in QUESTIONS[:4]],
        [row["prompt"] for row in QUESTIONS[4:]],
    ]


def test_csv_builder_with_data_files(tmp_path):
    data_files = write_csv(tmp_path / "questions.csv", QUESTIONS)

    datamodule = set_up(path="csv", data_files=data_files, batch_size=4)

    # The csv builder infers column types: the answers "0", "2", ... come back as integers.
    integer_answers = {prompt: int(answer) for prompt, answer in ANSWERS_BY_PROMPT.items()}
    assert answers_by_prompt(datamodule.train_dataloader()) == integer_answers


def prompt_order(seed, data_files):
    datamodule = set_up(path="json", data_files=data_files, batch_size=1, seed=seed)
    return [prompt for batch in datamodule.train_dataloader() for prompt in batch.prompts]


def test_shuffling_is_reproducible_and_depends_on_the_seed(tmp_path):
    data_files = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)

    order = prompt_order(0, data_files)

    assert sorted(order) == sorted(row["prompt"] for row in QUESTIONS)
    assert order != [row["prompt"] for row in QUESTIONS]
    assert prompt_order(0, data_files) == order
    assert prompt_order(1, data_files) != order


def test_each_epoch_gets_a_new_order(tmp_path):
    data_files = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)
    loader = set_up(path="json", data_files=data_files, batch_size=1).train_dataloader()

    first_epoch = [batch.prompts[0] for batch in loader]
    loader.sampler.set_epoch(1)  # what Lightning's fit loop does at the start of every epoch
    second_epoch = [batch.prompts[0] for batch in loader]

    assert sorted(first_epoch) == sorted(second_epoch)
    assert first_epoch != second_epoch


def test_validation_split_from_the_same_files(tmp_path):
    data_files = {
        "train": write_jsonl(tmp_path / "train.jsonl", QUESTIONS),
        "validation": write_jsonl(tmp_path / "validation.jsonl", QUESTIONS[:3]),
    }

    datamodule = set_up(path="json", data_files=data_files, batch_size=2, val_split="validation")
    batches = list(datamodule.val_dataloader())

    # In file order, and the incomplete last batch is kept.
    assert [batch.prompts for batch in batches] == [
        [row["prompt"] for row in QUESTIONS[:2]],
        [QUESTIONS[2]["prompt"]],
    ]


def test_validation_from_its_own_files(tmp_path):
    datamodule = set_up(
        path="json",
        data_files=write_jsonl(tmp_path / "train.jsonl", QUESTIONS),
        val_data_files=write_jsonl(tmp_path / "validation.jsonl", QUESTIONS[:1]),
        val_split="train",
        batch_size=2,
    )

    assert [batch.prompts for batch in datamodule.val_dataloader()] == [[QUESTIONS[0]["prompt"]]]


def test_no_validation_loader_without_val_split(tmp_path):
    datamodule = set_up(path="json", data_files=write_jsonl(tmp_path / "q.jsonl", QUESTIONS))

    # Lightning's convention for "no validation data": val_dataloader is not overridden.
    assert not is_overridden("val_dataloader", datamodule)
    assert not is_overridden("val_dataloader", pickle.loads(pickle.dumps(datamodule)))
    assert is_overridden("val_dataloader", GRPODataModule(path="json", val_split="validation"))


def test_batch_survives_lightning_device_transfer():
    batch = PromptBatch(
        prompts=["a", [{"role": "user", "content": "b"}]],
        columns={"answer": ["1", "2"], "level": [0, 1]},
    )

    moved = move_data_to_device(batch, torch.device("cpu"))

    assert isinstance(moved, PromptBatch)
    assert moved == batch


class RecordingModule(pl.LightningModule):
    """Records the batches it is given and takes a trivial optimizer step."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.training_batches = []

    def training_step(self, batch, batch_idx):
        self.training_batches.append(batch)
        return (self.weight**2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValidatingModule(RecordingModule):
    def __init__(self):
        super().__init__()
        self.validation_batches = []

    def validation_step(self, batch, batch_idx):
        self.validation_batches.append(batch)


def fit(module, datamodule, root_dir):
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root_dir,
    )
    trainer.fit(module, datamodule=datamodule)


def test_trainer_feeds_prompt_batches_without_validation_warnings(tmp_path, recwarn):
    data_files = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    datamodule = GRPODataModule(path="json", data_files=data_files, batch_size=2)
    module = RecordingModule()

    fit(module, datamodule, tmp_path)

    assert len(module.training_batches) == 3
    assert all(isinstance(batch, PromptBatch) and len(batch) == 2 for batch in module.training_batches)
    assert answers_by_prompt(module.training_batches).items() <= ANSWERS_BY_PROMPT.items()
    assert not [warning for warning in recwarn if "val" in str(warning.message)]


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_trainer_validates_only_with_val_split(tmp_path):
    data_files = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    without_split, with_split = ValidatingModule(), ValidatingModule()

    fit(without_split, GRPODataModule(path="json", data_files=data_files, batch_size=4), tmp_path)
    validated = GRPODataModule(path="json", data_files=data_files, batch_size=4, val_split="train[:3]")
    fit(with_split, validated, tmp_path)

    assert without_split.validation_batches == []
    validation_prompts = [batch.prompts for batch in with_split.validation_batches]
    assert validation_prompts == [[row["prompt"] for row in QUESTIONS[:3]]]


# Errors: each raised before training and naming what is wrong.


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        GRPODataModule(path="json", batch_size=0)


def test_val_data_files_need_val_split():
    with pytest.raises(ValueError, match="val_data_files='v.jsonl' is set but val_split is not"):
        GRPODataModule(path="json", data_files="t.jsonl", val_data_files="v.jsonl")


def test_missing_prompt_column_lists_the_columns(tmp_path):
    data_files = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)

    columns = r"\['prompt', 'answer', 'level'\]"
    with pytest.raises(ValueError, match=rf"prompt_column='question' is not a column.*columns are {columns}"):
        set_up(path="json", data_files=data_files, prompt_column="question")


def test_missing_data_file_names_the_file(tmp_path):
    missing = str(tmp_path / "nowhere.jsonl")

    with pytest.raises(ValueError, match=r"could not load the dataset path='json'.*nowhere\.jsonl"):
        set_up(path="json", data_files=missing)


def test_missing_file_given_as_path_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere\.jsonl"):
        set_up(path=str(tmp_path / "nowhere.jsonl"))


def test_file_as_path_excludes_data_files(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)

    with pytest.raises(ValueError, match=r"is a data file, so data_files='other\.jsonl' must be unset"):
        set_up(path=path, data_files="other.jsonl")


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")

    with pytest.raises(ValueError, match=r"data file '.*empty\.jsonl' of the dataset path='json'.* is empty"):
        set_up(path="json", data_files=str(empty))


def test_split_without_rows(tmp_path):
    data_files = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)

    with pytest.raises(ValueError, match=r"split='train\[8:\]'.*no data"):
        set_up(path="json", data_files=data_files, split="train[8:]")


def test_dataset_without_rows(monkeypatch):
    empty_dataset = datasets.Dataset.from_dict({"prompt": []})
    monkeypatch.setattr(data_module.datasets, "load_dataset", lambda *args, **kwargs: empty_dataset)

    with pytest.raises(ValueError, match=r"dataset path='some/dataset' \(split='train'\) has no rows"):
        set_up(path="some/dataset")


def test_fewer_rows_than_batch_size(tmp_path):
    data_files = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:3])

    with pytest.raises(ValueError, match=r"q\.jsonl.* has 3 rows, fewer than batch_size=4"):
        set_up(path="json", data_files=data_files, batch_size=4)


@pytest.mark.parametrize(
    ("bad_prompt", "shown"),
    [
        ("", "''"),
        (None, "None"),
        ([], r"\[\]"),
        (["just text"], r"\['just text'\]"),
        ([{"role": "user"}], r"\[\{'role': 'user'\}\]"),
        ([{"role": "user", "content": 7}], r"'content': 7"),
    ],
)
def test_invalid_prompt_names_row_and_value(tmp_path, bad_prompt, shown):
    good_prompt = "fine" if isinstance(bad_prompt, str | None) else [{"role": "user", "content": "fine"}]
    rows = [{"prompt": good_prompt}, {"prompt": good_prompt}, {"prompt": bad_prompt}]
    data_files = write_jsonl(tmp_path / "q.jsonl", rows)

    message = rf"row 2 of the dataset path='json'.*column 'prompt' must hold.*got .*{shown}"
    with pytest.raises(ValueError, match=message):
        set_up(path="json", data_files=data_files, batch_size=1)


def test_invalid_validation_prompt_names_the_validation_split(tmp_path):
    data_files = {
        "train": write_jsonl(tmp_path / "train.jsonl", QUESTIONS),
        "validation": write_jsonl(tmp_path / "validation.jsonl", [{"prompt": "ok"}, {"prompt": ""}]),
    }

    with pytest.raises(ValueError, match=r"row 1 of the dataset .*split='validation'"):
        set_up(path="json", data_files=data_files, val_split="validation")


@pytest.mark.parametrize("reserved", ["prompts", "completions", "completion_ids"])
def test_reserved_column_names(tmp_path, reserved):
    rows = [{"prompt": row["prompt"], reserved: "x"} for row in QUESTIONS]
    data_files = write_jsonl(tmp_path / "q.jsonl", rows)

    with pytest.raises(ValueError, match=rf"column\(s\) \['{reserved}'\] whose names are reserved"):
        set_up(path="json", data_files=data_files)


def test_prompts_may_be_the_prompt_column(tmp_path):
    rows = [{"prompts": row["prompt"]} for row in QUESTIONS]
    data_files = write_jsonl(tmp_path / "q.jsonl", rows)

    datamodule = set_up(path="json", data_files=data_files, prompt_column="prompts")

    assert next(iter(datamodule.train_dataloader())).columns == {}
