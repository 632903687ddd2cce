# Calls 1 and 2 of a lease whose last call runs the engine: the GGUF's parts (and the wheels)
# to /root/parts, nothing else.
mkdir -p /root/parts && cp .carry/p1/* .carry/p2/* /root/parts/ 2>/dev/null; ls -la /root/parts | tail -3
