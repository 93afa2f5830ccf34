"""Training data: tokenizers, the indexed token dataset format, text preprocessing, the
demo corpus, and the loader (samples, shuffling, blending, dp/cp sharding, resume).

Modules: ``tokenizer`` (ByteTokenizer, HFTokenizer, train_bpe, load_tokenizer),
``documents`` (input files and their documents), ``indexed_dataset`` (.bin/.idx),
``preprocess`` (text -> dataset), ``corpus`` (demo corpus, data.path -> prefixes),
``loader`` (GPTDataset, BlendedDataset, DataLoader, cp_zigzag_slice, dataset_from_config).
"""

from moe_fold.data.corpus import demo_corpus_files, ensure_demo_dataset, prepare_data_paths
from moe_fold.data.indexed_dataset import (DatasetFormatError, IndexedDataset, IndexedDatasetWriter,
                                           write_indexed_dataset)
from moe_fold.data.loader import (Batch, BlendedDataset, DataLoader, GPTDataset, Sample, batches,
                                  cp_zigzag_slice, dataset_from_config, open_training_dataset,
                                  zigzag_positions)
from moe_fold.data.preprocess import BuildSummary, build_dataset
from moe_fold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

__all__ = [
    "Batch", "BlendedDataset", "BuildSummary", "ByteTokenizer", "DataLoader", "DatasetFormatError",
    "GPTDataset", "HFTokenizer", "IndexedDataset", "IndexedDatasetWriter", "Sample", "batches",
    "build_dataset", "cp_zigzag_slice", "dataset_from_config", "demo_corpus_files", "ensure_demo_dataset", "load_tokenizer",
    "open_training_dataset", "prepare_data_paths", "train_bpe", "write_indexed_dataset", "zigzag_positions",
]
