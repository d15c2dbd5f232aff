// Validates the custom resources in a rendered manifest (JSON list on stdin) against the
// prometheus-operator schemas from @kubernetes-models/prometheus-operator; prints one line
// per resource and exits 1 on the first invalid one. Kubernetes' own kinds are checked by
// kubernetes-validate.
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const models = { "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor };
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
let failed = false;
for (const resource of JSON.parse(Buffer.concat(chunks).toString())) {
  const Model = models[`${resource.apiVersion}/${resource.kind}`];
  if (!Model) continue;
  try {
    new Model(resource).validate();
    console.log(`valid ${resource.kind}/${resource.metadata.name}`);
  } catch (error) {
    console.log(`invalid ${resource.kind}/${resource.metadata.name}: ${error.message}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
