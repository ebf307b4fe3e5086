"""ds_recycle: ReCycle for DeepSpeed pipelines."""
