mkdir -p /root/parts /root/res && cp .carry/p2/* /root/parts/ && ls -la /root/parts
