"""Training data. Import from the modules (this package imports nothing itself, so
``moe-fold data --help`` and the other subcommands do not pay for torch):

- ``tokenizer``: ByteTokenizer, HFTokenizer, train_bpe, load_tokenizer
- ``documents``: input files and the documents in them (text, JSONL)
- ``indexed_dataset``: moe-fold's .bin/.idx format (IndexedDatasetWriter, IndexedDataset, DatasetFormatError)
- ``megatron_dataset``: Megatron-LM's MMIDIDX .bin/.idx (MegatronDataset, MegatronDatasetWriter)
- ``flat_tokens``: .npy and raw .bin token files (FlatTokens)
- ``hf_datasets``: Hugging Face save_to_disk folders and Parquet (ArrowTokens; pyarrow)
- ``sources``: which format a data.path entry is, one reader interface, the pre-spawn check_data
- ``inspect``: ``moe-fold data inspect``
- ``preprocess``: text -> dataset (build_dataset)
- ``corpus``: the demo corpus (the standard library's source), data.path -> dataset prefixes
- ``loader``: GPTDataset, BlendedDataset, DataLoader, cp_zigzag_slice, dataset_from_config
"""
