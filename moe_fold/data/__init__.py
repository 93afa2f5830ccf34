"""Training data. Import from the modules (this package imports nothing itself, so
``moe-fold data --help`` and the other subcommands do not pay for torch):

- ``tokenizer``: ByteTokenizer, HFTokenizer, train_bpe, load_tokenizer
- ``documents``: input files and the documents in them (text, JSONL)
- ``indexed_dataset``: the .bin/.idx format (IndexedDatasetWriter, IndexedDataset, DatasetFormatError)
- ``preprocess``: text -> dataset (build_dataset)
- ``corpus``: the demo corpus (the standard library's source), data.path -> dataset prefixes
- ``loader``: GPTDataset, BlendedDataset, DataLoader, cp_zigzag_slice, dataset_from_config
"""
