"""What hal0d tells about itself: the request's record, history, metrics, the event feed."""
