# Prometheus from Debian's package, for sites (and tests) that cannot pull prom/prometheus:
# scripts/build_images.sh puts the binary of `apt-get download prometheus` beside this file
# in a build context of its own and builds it on the debootstrap base as
# lpsync-prometheus:dev; deploy/compose/offline.override.yml swaps it in. It behaves as
# prom/prometheus does for docker-compose.yml: the entrypoint is prometheus, the working
# directory /prometheus holds the data, it runs as nobody.
ARG BASE_IMAGE=lpsync-base:bookworm
FROM ${BASE_IMAGE}
LABEL org.lpsync.image=1
COPY prometheus /bin/prometheus
# Debian's build keeps its data in /var/lib/prometheus/metrics2 unless told otherwise.
RUN install -d -o nobody -g nogroup /prometheus /etc/prometheus /var/lib/prometheus \
 && ln -s /prometheus /var/lib/prometheus/metrics2
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
