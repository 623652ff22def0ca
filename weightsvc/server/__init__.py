"""The process: both transports on one event loop, the relay and the loop monitor."""
