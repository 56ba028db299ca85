"""``snapline ui``: the job overview and checkpoint-history web page."""
