"""``dsv3serve bench model``: DeepSeek-V3's prefill, decode and MTP step costs at full width."""
