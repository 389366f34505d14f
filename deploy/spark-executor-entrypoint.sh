#!/bin/bash
# Spark on Kubernetes starts each executor pod from spark.kubernetes.container.image with the one
# argument "executor" and its settings in SPARK_* variables; Spark's own images handle that in their
# entrypoint. This image is Sluice's (same Python and packages as the driver), so it does the same here:
# start Spark's KubernetesExecutorBackend from pyspark's jars. Anything else runs as given.
set -euo pipefail

if [ "${1:-}" != executor ]; then
  exec "$@"
fi

# SPARK_JAVA_OPT_0, _1, ...: the executor's JVM options (Java 17 module opens among them), in order
java_opts=()
for name in $(compgen -e | grep '^SPARK_JAVA_OPT_[0-9]*$' | sort -t_ -k4 -n); do
  java_opts+=("${!name}")
done

classpath="${SPARK_CONF_DIR:-$SPARK_HOME/conf}:$SPARK_HOME/jars/*"
if [ -n "${SPARK_CLASSPATH:-}" ]; then
  classpath="$SPARK_CLASSPATH:$classpath"
fi

exec "$JAVA_HOME/bin/java" "${java_opts[@]}" \
  "-Xms$SPARK_EXECUTOR_MEMORY" "-Xmx$SPARK_EXECUTOR_MEMORY" \
  -cp "$classpath" \
  org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
  --driver-url "$SPARK_DRIVER_URL" \
  --executor-id "$SPARK_EXECUTOR_ID" \
  --cores "$SPARK_EXECUTOR_CORES" \
  --app-id "$SPARK_APPLICATION_ID" \
  --hostname "$SPARK_EXECUTOR_POD_IP" \
  --resourceProfileId "$SPARK_RESOURCE_PROFILE_ID" \
  --podName "$SPARK_EXECUTOR_POD_NAME"
